// Token sampling: greedy, temperature, top-k, top-p (nucleus), seeded.
#include <algorithm>
#include <cmath>
#include <string>

#include "edgeattn/session.hpp"

namespace edgeattn {

Sampler::Sampler(const SamplingOptions& options) : opt_(options), rng_(options.seed) {
  if (!(opt_.top_p > 0.0f && opt_.top_p <= 1.0f)) throw InputError("top_p must be in (0, 1], got " + std::to_string(opt_.top_p));
  if (opt_.top_k < 0) throw InputError("top_k must be >= 0, got " + std::to_string(opt_.top_k));
  if (!std::isfinite(opt_.temperature)) throw InputError("temperature must be finite");
}

int64_t Sampler::sample(const std::vector<float>& logits) {
  if (logits.empty()) throw InputError("cannot sample from empty logits");
  // NaN would be argmax'ed or sampled as some token, inf as always the same one: a model whose weights or state
  // are not finite is refused, never decoded.
  for (size_t i = 0; i < logits.size(); ++i)
    if (!std::isfinite(logits[i]))
      throw RuntimeError("the model's logits are not finite (" + std::to_string(logits[i]) + " at token id " +
                         std::to_string(i) + "): its weights or state hold NaN or inf; nothing was sampled");
  if (opt_.temperature <= 0.0f)  // greedy; std::max_element keeps the first maximum, like numpy.argmax
    return std::max_element(logits.begin(), logits.end()) - logits.begin();

  // (scaled logit, id), most likely first; top-k cuts the sorted list.
  auto& c = scratch_;
  c.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) c[i] = {logits[i] / opt_.temperature, static_cast<int64_t>(i)};
  size_t keep = c.size();
  if (opt_.top_k > 0) keep = std::min(keep, static_cast<size_t>(opt_.top_k));
  auto by_prob = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  std::partial_sort(c.begin(), c.begin() + keep, c.end(), by_prob);
  c.resize(keep);

  // softmax over the kept tokens, stable against large logits
  const float top = c[0].first;
  double total = 0.0;
  for (auto& [v, id] : c) total += (v = std::exp(v - top));
  // top-p: the smallest prefix whose probability mass reaches top_p
  if (opt_.top_p < 1.0f) {
    double mass = 0.0;
    size_t n = 0;
    while (n < c.size() && mass < opt_.top_p * total) mass += c[n++].first;
    c.resize(std::max<size_t>(n, 1));
    total = mass > 0.0 ? mass : c[0].first;
  }
  // a uniform double in [0, total) from 53 random bits: the same draw on every platform for a given seed
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  double acc = 0.0;
  for (const auto& [p, id] : c) {
    acc += p;
    if (u < acc) return id;
  }
  return c.back().second;
}

}  // namespace edgeattn
