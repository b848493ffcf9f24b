"""Export-time graph pass for the ``onnxruntime`` target: a decode graph as lean as onnxruntime-genai's.

``optimize_graph(model)`` rewrites a float32 ONNX model (torch's export) in place, in this order:

0. In a graph with a dynamic token axis (``TOKEN_AXIS``: the one graph for step and prefill, ``--genai``'s
   model.onnx), the Reshape targets that torch computes at run time (Shape, Gather, Unsqueeze, Concat)
   become constants with a -1 for the token axis, found by running the graph at 3 and 5 tokens; every
   value gets its shape with the token axis by name, so the fusions below see equal shapes.
1. ``Identity`` nodes and ``Cast`` nodes to the type their input already has are bypassed (torch writes
   them for ``x.float()`` and tied parameters; ONNX Runtime drops them too, but they hide the patterns).
2. RMSNorm ``x * 1 / sqrt(mean(x^2, -1) + eps) [* w]`` becomes ONNX Runtime's ``SimplifiedLayerNormalization``
   (a contrib op that ONNX Runtime registers in the default domain, as onnxruntime-genai writes it)
   (``axis=-1``, ``stash_type=1``; ``w`` of ones where the graph has none, as in a per-head norm whose
   weight is applied after a reshape).
3. A residual ``Add`` whose sum feeds a SimplifiedLayerNormalization (and the rest of the residual
   stream) becomes ``com.microsoft.SkipSimplifiedLayerNormalization``, whose fourth output is the sum.
4. MatMuls that read the same activation with 2-D initializer weights (q/k/v, gates, SwiGLU's gate and
   up) become one MatMul over the weights concatenated along N, followed by a ``Split``.
5. A Concat of consecutive outputs of such a Split becomes one output of it (q|k|v before the delta rules'
   short convolution).
6. ``Reshape(Reshape(x, a), b)`` reads ``x`` directly, and Reshapes to the shape their input already has
   go (torch's ``view`` to heads and back around the fused recurrence).

Checkpoints and the torch model are untouched: only the exported graph changes, and the tests compare
its logits and states with the unoptimized graph's. The ``portable`` target keeps standard opset-17
ops (TensorRT 10 parses neither contrib op), so the pass runs for ``onnxruntime`` only.
"""

from __future__ import annotations

import numpy as np

from edgeattn.export.graph import (  # noqa: F401  (LARGE_ELEMENTS: tests patch it through this module too)
    LARGE_ELEMENTS,
    MS,
    ORT_DEFAULT_DOMAIN_OPS,
    initializer_array,
    initializer_nbytes,
    is_by_reference,
    remove_initializers,
    sort_topologically,
    without_large_weights,
)

TOKEN_AXIS = "sequence_length"  # the dynamic token axis of exported graphs, as onnxruntime-genai names it
PROBE_TOKENS = (3, 5)  # token counts the graph is run at to tell which dimensions follow the token axis


class _Graph:
    """Producer/consumer maps over ``model.graph`` plus the initializers as numpy arrays (read on demand)."""

    def __init__(self, model):
        self.model = model
        self.g = model.graph
        self.refresh()

    def refresh(self) -> None:
        self.inits = {i.name: i for i in self.g.initializer}
        self.producer = {o: n for n in self.g.node for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in self.g.node:
            for x in n.input:
                self.consumers.setdefault(x, []).append(n)
        self.outputs = {o.name for o in self.g.output}

    def const(self, name: str):
        """The value of an initializer or Constant node output, else None."""
        from onnx import numpy_helper

        if name in self.inits:
            return initializer_array(self.inits[name])
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        return None

    def only_consumer(self, name: str, op_type: str):
        users = self.consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op_type and name not in self.outputs:
            return users[0]
        return None

    def rename_input(self, old: str, new: str) -> None:
        for n in self.g.node:
            n.input[:] = [new if x == old else x for x in n.input]


def _attr(node, name, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


# ops ONNX's inference does not know whose listed outputs have the shape of their first input
SHAPE_PRESERVING = {"SimplifiedLayerNormalization": (0,), "SkipSimplifiedLayerNormalization": (0, 3)}


def _infer(model) -> tuple[dict[str, int], dict[str, list]]:
    """Element type and shape (None for an unknown dimension) of every value ONNX's inference can tell.
    Outputs of ops it does not know (contrib ops) get their first input's type, the norms' outputs its
    shape too, and inference runs again from there. It runs on a copy without the large weights' bytes
    (the inference serializes its model, which protobuf refuses over 2 GB; it needs their shapes only)."""

    return _infer_light(without_large_weights(model)[0])


def _infer_light(model) -> tuple[dict[str, int], dict[str, list]]:
    import onnx

    m = model
    for _ in range(len(model.graph.node) + 1):  # each round passes at least one more unknown op
        m = onnx.shape_inference.infer_shapes(m)
        g = m.graph
        values = [*g.input, *g.value_info, *g.output]
        types = {v.name: v.type.tensor_type.elem_type for v in values if v.type.tensor_type.elem_type}
        types.update({i.name: i.data_type for i in g.initializer})
        shapes = {v.name: _dims(v) for v in values if v.type.tensor_type.HasField("shape")}
        shapes.update({i.name: list(i.dims) for i in g.initializer})
        added = False
        for n in g.node:
            if not n.input or n.input[0] not in types or onnx.defs.has(n.op_type, n.domain):
                continue
            keep = SHAPE_PRESERVING.get(n.op_type, ())
            if keep and n.input[0] not in shapes:
                continue  # wait for the input's shape
            for k, o in enumerate(n.output):
                if o and o not in types:
                    shape = shapes.get(n.input[0]) if k in keep else None
                    g.value_info.append(onnx.helper.make_tensor_value_info(o, types[n.input[0]], shape))
                    added = True
        if not added:
            break
    _infer.last = m  # the model with every value's type, for optimize_graph's value_info
    return types, shapes


def _dims(value) -> list:
    """A ValueInfo's dimensions: ints, the token axis by name (one symbol, so two values that both have it
    agree there), None for any other unknown."""
    return [
        d.dim_value if d.HasField("dim_value") else (TOKEN_AXIS if d.dim_param == TOKEN_AXIS else None)
        for d in value.type.tensor_type.shape.dim
    ]


def _key(node) -> tuple:
    return tuple(node.output)  # outputs are unique names (protobuf gives no stable object identity)


def _drop_nodes(G: _Graph, nodes) -> None:
    ids = {_key(n) for n in nodes}
    keep = [n for n in G.g.node if _key(n) not in ids]
    del G.g.node[:]
    G.g.node.extend(keep)


def remove_redundant(model) -> int:
    """Bypass Identity nodes and Casts to their input's own type; returns how many were removed."""
    types, _ = _infer(model)
    G = _Graph(model)
    dead = []
    for n in list(G.g.node):
        same = n.op_type == "Identity" or (
            n.op_type == "Cast"
            and types.get(n.input[0]) is not None
            and types.get(n.input[0]) == _attr(n, "to")
        )
        if not same or n.output[0] in G.outputs:
            continue
        G.rename_input(n.output[0], n.input[0])
        dead.append(n)
    _drop_nodes(G, dead)
    return len(dead)


def _scalar(G: _Graph, name: str):
    v = G.const(name)
    return None if v is None or v.size != 1 else float(v.reshape(-1)[0])


def _reduce_last(G: _Graph, name: str):
    """The ReduceMean or ReduceSum over the last axis (keepdims) that alone reads ``name``, else None."""
    for op in ("ReduceMean", "ReduceSum"):
        node = G.only_consumer(name, op)
        if node is None or _attr(node, "keepdims", 1) != 1:
            continue
        axes = _attr(node, "axes", None)
        if axes is None and len(node.input) > 1:  # opset 13+ ReduceSum (18+ ReduceMean): an input
            axes = G.const(node.input[1])
        if axes is not None and [int(a) for a in np.ravel(axes)] == [-1]:
            return node
    return None


def fuse_rms_norm(model) -> int:
    """x * (1 / sqrt(mean(x^2, -1) + eps)) [* w] -> SimplifiedLayerNormalization(x, w). The L2 norm
    x * (1 / sqrt(sum(x^2, -1) + eps)) (the delta rule's q and k) is the same op with D the last dimension:
    sum = D * mean, so it is SimplifiedLayerNormalization(x, w / sqrt(D)) with epsilon eps / D."""
    from onnx import TensorProto, helper, numpy_helper

    _, shapes = _infer(model)
    G = _Graph(model)
    count = 0
    for pow_ in [n for n in G.g.node if n.op_type == "Pow"]:
        if _scalar(G, pow_.input[1]) != 2.0:
            continue
        x = pow_.input[0]
        mean = _reduce_last(G, pow_.output[0])
        if mean is None:
            continue
        dim = (shapes.get(x) or [None])[-1]
        summed = mean.op_type == "ReduceSum"
        if summed and (not isinstance(dim, int) or not dim):
            continue
        add = G.only_consumer(mean.output[0], "Add")
        if add is None:
            continue
        eps = _scalar(G, add.input[1] if add.input[0] == mean.output[0] else add.input[0])
        sqrt = G.only_consumer(add.output[0], "Sqrt")
        div = sqrt and G.only_consumer(sqrt.output[0], "Div")
        if eps is None or div is None or div.input[1] != sqrt.output[0] or _scalar(G, div.input[0]) != 1.0:
            continue
        mul = G.only_consumer(div.output[0], "Mul")
        if mul is None or x not in mul.input:
            continue
        chain = [pow_, mean, add, sqrt, div, mul]
        out, scale, weight = mul.output[0], None, None
        wmul = G.only_consumer(out, "Mul")
        if wmul is not None:
            other = wmul.input[1] if wmul.input[0] == out else wmul.input[0]
            w = G.const(other)
            if w is not None and w.ndim == 1 and w.dtype == np.float32:
                scale, weight, out = other, w, wmul.output[0]
                chain.append(wmul)
        if scale is None or summed:
            if not isinstance(dim, int) or not dim:
                continue
            values = np.ones(dim, np.float32) if weight is None else weight
            if summed:
                values = (values / np.sqrt(np.float32(dim))).astype(np.float32)
            scale = f"{mul.output[0]}.{'l2' if summed else 'ones'}"
            G.g.initializer.append(numpy_helper.from_array(values, scale))
        node = helper.make_node(
            "SimplifiedLayerNormalization",
            [x, scale],
            [out],
            name=f"{mul.name or out}/SimplifiedLayerNormalization",
            axis=-1,
            epsilon=eps / dim if summed else eps,
            stash_type=TensorProto.FLOAT,
        )
        _drop_nodes(G, chain)
        G.g.node.append(node)  # put in place by the final topological sort
        G.refresh()
        count += 1
    return count


def fuse_skip_norm(model) -> int:
    """Add(a, b) -> SimplifiedLayerNormalization(sum) with the sum also read elsewhere ->
    SkipSimplifiedLayerNormalization(a, b) with outputs (normalized, -, -, sum)."""
    from onnx import helper

    _, shapes = _infer(model)
    G = _Graph(model)
    count = 0
    for norm in [n for n in G.g.node if n.op_type == "SimplifiedLayerNormalization"]:
        add = G.producer.get(norm.input[0])
        if add is None or add.op_type != "Add" or any(G.const(i) is not None for i in add.input):
            continue
        # no broadcasting inside the fused op: both 3-D and equal where inference knows both (it stops at
        # contrib ops, so one side may be unknown; the other must then be known in full)
        known = [s for s in (shapes.get(i) for i in add.input) if s]
        if not known or any(len(s) != 3 or None in s or s != known[0] for s in known):
            continue
        node = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]],
            name=f"{norm.name}/Skip",
            domain=MS,
            epsilon=_attr(norm, "epsilon"),
        )
        _drop_nodes(G, [add, norm])
        G.g.node.append(node)
        G.refresh()
        count += 1
    return count


def _probe(model) -> list[dict[str, np.ndarray]] | None:
    """Every value of ``model`` (one whose ``input_ids`` has a dynamic token axis) computed by ONNX Runtime
    at each of ``PROBE_TOKENS`` tokens from a zero state, or None when the graph has no such axis or a
    dynamic state dimension (a growing KV cache: nothing to feed it)."""
    import onnx
    import onnxruntime as ort

    inputs = {i.name: i for i in model.graph.input}
    ids = inputs.get("input_ids")
    if ids is None or ids.type.tensor_type.shape.dim[1].dim_param != TOKEN_AXIS:
        return None
    shapes = {n: _dims(v) for n, v in inputs.items()}
    if any(d is None or d == TOKEN_AXIS for n, s in shapes.items() if n != "input_ids" for d in s):
        return None
    # The large weights become inputs fed zeros: the probe stays far under protobuf's 2 GB whatever the
    # model's size, and np.zeros' untouched pages cost no memory. Shapes do not depend on weight values.
    probe, big = without_large_weights(model)
    # an initializer that is also a graph input (an optional input with a default: a "last" graph's
    # logits_count) keeps its value: the probe's shapes are those of a caller that does not feed it
    defaults = {i.name: i for i in model.graph.initializer if i.name in big and i.name in inputs}
    big -= set(defaults)
    probe = onnx.ModelProto(
        ir_version=probe.ir_version,
        opset_import=probe.opset_import,
        graph=onnx.GraphProto(
            name=probe.graph.name,
            node=probe.graph.node,
            input=[
                *probe.graph.input,
                *[
                    onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                    for i in model.graph.initializer
                    if i.name in big
                ],
            ],
            output=probe.graph.output,
            initializer=[defaults.get(i.name, i) for i in probe.graph.initializer if i.name not in big],
        ),
    )
    have = {o.name for o in probe.graph.output}
    for n in probe.graph.node:
        probe.graph.output.extend(onnx.ValueInfoProto(name=o) for o in n.output if o and o not in have)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    types = {1: np.float32, 6: np.int32, 7: np.int64, 10: np.float16, 2: np.uint8, 3: np.int8}
    runs = []
    for t in PROBE_TOKENS:
        feed = {}
        for v in probe.graph.input:
            n = v.name
            if n not in inputs:  # a large weight
                dims = [d.dim_value for d in v.type.tensor_type.shape.dim]
                feed[n] = np.zeros(dims, types[v.type.tensor_type.elem_type])
                continue
            if n in {i.name for i in model.graph.initializer}:
                continue
            shape = [shapes[n][0], t] if n == "input_ids" else shapes[n]
            feed[n] = np.zeros(shape, types.get(v.type.tensor_type.elem_type, np.float32))
        runs.append(dict(zip(names, sess.run(names, feed))))
    return runs


def fold_token_shapes(model) -> int:
    """In a graph with a dynamic token axis (every other dimension static) torch computes each Reshape's
    target at run time (Shape, Gather, Unsqueeze, Concat: dozens of nodes a layer). The graph is run at
    two token counts (``_probe``); a Reshape whose output changes in at most one dimension gets a constant
    target with -1 there. Every value then gets its probed shape as value_info, the token axis named
    ``TOKEN_AXIS``, so that the fusions below see equal shapes. Returns how many targets became constants."""
    from onnx import helper, numpy_helper

    runs = _probe(model)
    if runs is None:
        return 0
    G = _Graph(model)
    count = 0
    for n in G.g.node:
        if n.op_type != "Reshape" or G.const(n.input[1]) is not None:
            continue
        # the shapes the Reshape produced (its target may hold a -1 already)
        a, b = (np.array(r[n.output[0]].shape, np.int64) if n.output[0] in r else None for r in runs)
        if a is None or b is None or a.shape != b.shape or (a <= 0).any():
            continue
        moving = np.flatnonzero(a != b)
        if len(moving) > 1:
            continue
        target = a.astype(np.int64).copy()
        target[moving] = -1
        name = f"{n.output[0]}.shape"
        G.g.initializer.append(numpy_helper.from_array(target, name))
        n.input[1] = name
        count += 1
    io = {v.name for v in [*model.graph.input, *model.graph.output]}
    elem = {np.dtype(np.float32): 1, np.dtype(np.int64): 7, np.dtype(np.float16): 10}
    infos = []
    for name, x in runs[0].items():
        y = runs[1][name]
        if name in io or x.ndim != y.ndim or x.dtype not in elem:
            continue
        dims = []
        for p, q in zip(x.shape, y.shape):
            dims.append(p if p == q else (TOKEN_AXIS if (p, q) == PROBE_TOKENS else None))
        infos.append(helper.make_tensor_value_info(name, elem[x.dtype], dims))
    del model.graph.value_info[:]
    model.graph.value_info.extend(infos)
    _drop_dead(model)
    return count


def fuse_reshapes(model) -> int:
    """Reshape(Reshape(x, a), b) -> Reshape(x, b) when ``b`` is constant and has no 0 (copy-a-dimension)
    entry; then Reshapes to the shape their input already has are bypassed. Returns how many went."""
    G = _Graph(model)
    count = 0
    for n in list(G.g.node):
        if n.op_type != "Reshape":
            continue
        first = G.producer.get(n.input[0])
        b = G.const(n.input[1])
        if first is not None and first.op_type == "Reshape" and b is not None and not (b == 0).any():
            n.input[0] = first.input[0]
    _drop_dead(model)
    _, shapes = _infer(model)
    G = _Graph(model)
    dead = []
    for n in list(G.g.node):
        if n.op_type != "Reshape" or n.output[0] in G.outputs:
            continue
        src, b = shapes.get(n.input[0]), G.const(n.input[1])
        if src and b is not None and _same_shape(src, [int(d) for d in b]):
            G.rename_input(n.output[0], n.input[0])
            dead.append(n)
            count += 1
    _drop_nodes(G, dead)
    _drop_dead(model)
    return count


def _same_shape(src: list, target: list[int]) -> bool:
    """Whether a Reshape to ``target`` leaves a value of shape ``src`` as it is: equal sizes, the token
    axis (at most one) against a -1."""
    if len(src) != len(target) or target.count(-1) > 1:
        return False
    return all(t == -1 if d == TOKEN_AXIS else d is not None and d == t for d, t in zip(src, target))


def fuse_matmuls(model) -> int:
    """MatMuls of one activation by 2-D float32 initializers -> one MatMul by [W1 | W2 | ...] and a Split.
    Returns how many MatMuls were removed."""
    from onnx import helper, numpy_helper

    G = _Graph(model)
    groups: dict[str, list] = {}
    for n in G.g.node:
        if n.op_type == "MatMul" and n.domain == "" and n.input[1] in G.inits:
            w = G.inits[n.input[1]]
            if len(w.dims) == 2 and w.data_type == 1 and G.const(n.input[0]) is None:
                groups.setdefault(n.input[0], []).append(n)
    removed = 0
    for x, nodes in groups.items():
        rows = {G.inits[n.input[1]].dims[0] for n in nodes}
        if len(nodes) < 2 or len(rows) != 1:
            continue
        weights = [initializer_array(G.inits[n.input[1]]) for n in nodes]
        name = "/".join(n.name or n.output[0] for n in nodes[:1]) + "/fused"
        G.g.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), f"{name}.weight"))
        sizes = np.array([w.shape[1] for w in weights], np.int64)
        G.g.initializer.append(numpy_helper.from_array(sizes, f"{name}.split"))
        fused = helper.make_node("MatMul", [x, f"{name}.weight"], [f"{name}.out"], name=f"{name}/MatMul")
        split = helper.make_node(
            "Split",
            [f"{name}.out", f"{name}.split"],
            [n.output[0] for n in nodes],
            name=f"{name}/Split",
            axis=-1,
        )
        _drop_nodes(G, nodes)
        G.g.node.extend([fused, split])
        removed += len(nodes) - 1
    # weights nobody reads any more
    used = {x for n in G.g.node for x in n.input}
    remove_initializers(G.g, {i.name for i in G.g.initializer if i.name not in used})
    return removed


def merge_split_concat(model) -> int:
    """Concat(axis=-1) of consecutive outputs of one Split(axis=-1), read by nothing else -> one output of
    that Split (the fused projections of q|k|v feeding the delta rules' short convolution)."""
    from onnx import numpy_helper

    G = _Graph(model)
    count = 0
    for cat in [n for n in G.g.node if n.op_type == "Concat" and _attr(n, "axis") == -1]:
        split = G.producer.get(cat.input[0])
        if split is None or split.op_type != "Split" or _attr(split, "axis") != -1 or len(split.input) < 2:
            continue
        outs = list(split.output)
        start = outs.index(cat.input[0])
        run = outs[start : start + len(cat.input)]
        sizes = G.const(split.input[1])
        if run != list(cat.input) or sizes is None or split.input[1] not in G.inits:
            continue
        if any(len(G.consumers.get(o, [])) != 1 or o in G.outputs for o in run):
            continue
        end = start + len(run)
        merged = np.concatenate([sizes[:start], [sizes[start:end].sum()], sizes[end:]]).astype(np.int64)
        name = f"{split.input[1]}.merged{count}"
        G.g.initializer.append(numpy_helper.from_array(merged, name))
        split.input[1] = name
        split.output[:] = [*outs[:start], cat.output[0], *outs[end:]]
        _drop_nodes(G, [cat])
        G.refresh()
        count += 1
    return count


WEIGHT_OPS = frozenset({"MatMul", "Gemm", "Gather", "MatMulNBits", "GatherBlockQuantized", "Conv"})


def share_constants(model, max_bytes: int = 2**27) -> int:
    """Let nodes that read equal initializers read one (the first by name): every GroupQueryAttention of a
    model with rotary embeddings traces its own copy of the same cos/sin tables. Weights of projections,
    embeddings and convolutions (``WEIGHT_OPS``) are left alone, as are tensors over ``max_bytes``.
    Returns the number of initializers removed."""
    import hashlib

    g = model.graph
    readers: dict[str, set] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, set()).add(n.op_type)
    io = {v.name for v in [*g.input, *g.output]}
    groups: dict[tuple, list] = {}
    data = {}  # the bytes of each candidate (a by-reference initializer's read from its scratch file)
    for init in g.initializer:
        by_ref = is_by_reference(init)
        if (
            not (init.raw_data or by_ref)
            or initializer_nbytes(init) > max_bytes
            or init.name in io
            or readers.get(init.name, set()) & WEIGHT_OPS
        ):
            continue
        data[init.name] = initializer_array(init).tobytes() if by_ref else init.raw_data
        key = (init.data_type, tuple(init.dims), hashlib.blake2b(data[init.name], digest_size=16).digest())
        groups.setdefault(key, []).append(init)
    rename = {}
    for inits in groups.values():
        keep = min(inits, key=lambda i: i.name)
        rename.update({i.name: keep.name for i in inits if i is not keep and data[i.name] == data[keep.name]})
    del data
    if not rename:
        return 0
    for n in g.node:
        for j, x in enumerate(n.input):
            if x in rename:
                n.input[j] = rename[x]
    remove_initializers(g, set(rename))
    return len(rename)


def unfuse_gated_norms(model) -> int:
    """Each ``com.microsoft.GatedRMSNorm`` (x, scale [C], gate) as a per-head SimplifiedLayerNormalization
    (x reshaped to [B, T, -1, C]) times silu(gate) or sigmoid(gate). ONNX Runtime 1.32's CPU GatedRMSNorm
    kernel ran 3x slower than these ops at one token and 17-40x slower at 64 to 256 tokens (2048 values a
    token, 2 threads; 9% of a Qwen3.5-0.8B int4 prefill: benchmarks/RESULTS.md). Returns the norms replaced."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    done, nodes_out = 0, []
    for n in g.node:
        x, scale, gate = (list(n.input) + ["", "", ""])[:3]
        src = scale  # torch's export reads equal weights through Identity nodes
        while src not in inits and src in producer and producer[src].op_type == "Identity":
            src = producer[src].input[0]
        if n.domain != MS or n.op_type != "GatedRMSNorm" or src not in inits or len(inits[src].dims) != 1:
            nodes_out.append(n)
            continue
        C = int(inits[src].dims[0])
        eps = _attr(n, "epsilon", 1e-5)
        act = _attr(n, "activation", b"silu")
        act = act.decode() if isinstance(act, bytes) else act
        heads, flat = f"gated_norm.heads.{C}", "gated_norm.flat"
        for name, value in ((heads, [0, 0, -1, C]), (flat, [0, 0, -1])):
            if name not in inits:
                inits[name] = numpy_helper.from_array(np.array(value, np.int64), name)
                g.initializer.append(inits[name])
        y, base = n.output[0], n.name or f"gated_norm_{done}"
        nodes = [
            helper.make_node("Reshape", [x, heads], [f"{base}.x"], name=f"{base}.heads"),
            helper.make_node(
                "SimplifiedLayerNormalization",
                [f"{base}.x", scale],
                [f"{base}.norm"],
                name=f"{base}.norm",
                axis=-1,
                epsilon=float(eps),
                stash_type=1,
            ),
            helper.make_node("Reshape", [f"{base}.norm", flat], [f"{base}.y"], name=f"{base}.flat"),
            helper.make_node("Sigmoid", [gate], [f"{base}.sig"], name=f"{base}.sigmoid"),
        ]
        if act in ("silu", "swish"):
            nodes.append(helper.make_node("Mul", [gate, f"{base}.sig"], [f"{base}.act"], name=f"{base}.silu"))
        nodes.append(helper.make_node("Mul", [f"{base}.y", nodes[-1].output[0]], [y], name=f"{base}.gate"))
        nodes_out += nodes
        done += 1
    if done:  # the node list rebuilt in order (protobuf copies the nodes it adds: they are small)
        kept = [type(n)() for n in nodes_out]
        for k, n in zip(kept, nodes_out):
            k.CopyFrom(n)
        del g.node[:]
        g.node.extend(kept)
    return done


def optimize_graph(model) -> dict[str, int]:
    """Run the passes on ``model`` (an onnx.ModelProto, changed in place); returns what each did."""
    from onnx import helper

    if not any(o.domain == MS for o in model.opset_import):  # the Skip norm lives there
        model.opset_import.append(helper.make_opsetid(MS, 1))
    done = {}
    for name, apply in (
        ("token_shapes", fold_token_shapes),
        ("gated_norms", unfuse_gated_norms),
        ("removed", remove_redundant),
        ("rms_norm", fuse_rms_norm),
        ("skip_norm", fuse_skip_norm),
        ("matmuls_removed", fuse_matmuls),
        ("concats", merge_split_concat),
        ("reshapes", fuse_reshapes),
        ("shared_constants", share_constants),
    ):
        done[name] = apply(model)
        _drop_dead(model)
        sort_topologically(model)  # fused nodes were appended; shape inference wants them in order
    # every value typed (inference stops at contrib ops): the float16 converter places its Casts by these
    _infer(model)
    io = {v.name for v in [*model.graph.input, *model.graph.output]}
    del model.graph.value_info[:]
    model.graph.value_info.extend(v for v in _infer.last.graph.value_info if v.name not in io)
    return done


def _drop_dead(model) -> None:
    """Nodes whose outputs nobody reads (Constants left by the fusions), and unread initializers."""
    g = model.graph
    while True:
        used = {x for n in g.node for x in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if not any(o in used for o in n.output if o)]
        if not dead:
            break
        ids = {_key(n) for n in dead}
        keep = [n for n in g.node if _key(n) not in ids]
        del g.node[:]
        g.node.extend(keep)
    used = {x for n in g.node for x in n.input}
    remove_initializers(g, {i.name for i in g.initializer if i.name not in used})


def checkable(model):
    """A copy of ``model`` that ``onnx.checker`` accepts: ONNX Runtime registers SimplifiedLayerNormalization
    in the default domain, where ONNX has no such op; moved to ``com.microsoft`` (which the checker leaves
    alone), everything else (standard ops, types, node order) is still checked."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for n in copy.graph.node:
        if n.domain == "" and n.op_type in ORT_DEFAULT_DOMAIN_OPS:
            n.domain = MS
    if not any(o.domain == MS for o in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid(MS, 1))
    return copy


# the optional input of a "last" artifact's graph: how many of a call's last tokens get logits (default 1)
LOGITS_COUNT = "logits_count"


def last_token_logits(model, logits: str = "logits") -> bool:
    """The head (the MatMul that writes ``logits``) on the last tokens of the call only: a Slice of its input
    [B, T, D] -> [B, L, D], so a call of T tokens returns logits [B, L, V] of its last L = min(n, T) tokens,
    where n is the optional input ``LOGITS_COUNT`` (int64 [1]; an initializer that is also a graph input, so a
    caller that does not feed it gets 1: the next token's logits). A prefill feeds nothing; a speculative
    verify call or scoring feeds T and gets every position's. At Qwen3.5-0.8B the tied head is a third of a
    token's multiply-adds (1024 x 248320 of ~0.75G)."""
    from onnx import TensorProto, helper, numpy_helper

    from edgeattn.export.graph import OFFSET_SUFFIX

    g = model.graph
    head = next((n for n in g.node if logits in n.output), None)
    readers = [head]  # the nodes that read the head's input
    if head is not None and head.op_type == "Add" and head.name.endswith(f"_add{OFFSET_SUFFIX}"):
        # an int4 head with block offsets (precision.offset_blocks): MatMulNBits + x @ blocks @ offsets
        producer = {o: n for n in g.node for o in n.output}
        codes, offsets = (producer.get(x) for x in head.input)
        sums = producer.get(offsets.input[0]) if offsets is not None else None
        readers = [codes, sums]
        if any(r is None for r in readers) or codes.input[0] != sums.input[0]:
            return False
        head = codes
    if head is None or head.op_type not in ("MatMul", "MatMulNBits", "FusedMatMul"):
        return False
    if any(i.name == LOGITS_COUNT for i in g.input) or any(i.name == LOGITS_COUNT for i in g.initializer):
        return False  # (a name the graph already uses)
    names = [f"{logits}_last.{k}" for k in ("starts", "ends", "axes")]
    values = ([np.iinfo(np.int64).max], [1])
    g.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in zip(names[1:], values))
    g.initializer.append(numpy_helper.from_array(np.array([1], np.int64), LOGITS_COUNT))
    g.input.append(helper.make_tensor_value_info(LOGITS_COUNT, TensorProto.INT64, [1]))
    last = f"{logits}_last.input"
    at = min(list(g.node).index(r) for r in readers)
    g.node.insert(
        at, helper.make_node("Slice", [head.input[0], *names], [last], name=f"{head.name}_last_token")
    )
    g.node.insert(at, helper.make_node("Neg", [LOGITS_COUNT], [names[0]], name=f"{head.name}_last_starts"))
    for r in readers:
        r.input[0] = last
    out = next(o for o in g.output if o.name == logits)
    dim = out.type.tensor_type.shape.dim[1]
    dim.ClearField("dim_value")
    dim.dim_param = "logits"
    return True


def share_tied_embedding(model) -> int:
    """A tied embedding stored once: torch's constant folding writes the output head's ``E^T`` [D, V] beside
    the token embedding ``E`` [V, D] read by a Gather. Where one initializer is exactly the transpose of
    another that only Gathers (axis 0) read, each such Gather reads ``E^T`` along axis 1 and a Transpose
    turns its small result back (``[D, *ids] -> [*ids, D]``), and ``E`` goes. Standard ONNX ops only (the
    ``portable`` target runs it too). Returns how many embeddings were dropped."""
    from onnx import helper

    G = _Graph(model)
    big = {
        name: i
        for name, i in G.inits.items()
        if len(i.dims) == 2 and i.dims[0] != i.dims[1] and (not i.external_data or is_by_reference(i))
    }
    by_shape: dict[tuple, list[str]] = {}
    for name, i in big.items():
        by_shape.setdefault(tuple(i.dims), []).append(name)
    dropped = 0
    for name, init in big.items():
        users = G.consumers.get(name, [])
        if not users or name in G.outputs:
            continue
        if any(n.op_type != "Gather" or n.domain != "" or n.input[0] != name for n in users):
            continue
        if any((_attr(n, "axis", 0) or 0) != 0 for n in users):
            continue
        V, D = init.dims
        table = None
        for other in by_shape.get((D, V), []):
            if big[other].data_type != init.data_type:
                continue
            if table is None:
                table = initializer_array(init)
            if np.array_equal(initializer_array(big[other]), table.T):
                break
        else:
            continue
        ranks = [_ids_rank(G, n.input[1]) for n in users]
        if None in ranks:
            continue
        for n, rank in zip(users, ranks):
            ranked = f"{n.output[0]}/by_column"  # [D, *ids]
            del n.attribute[:]
            n.attribute.append(helper.make_attribute("axis", 1))
            n.input[0] = other
            out = n.output[0]
            n.output[0] = ranked
            perm = [*range(1, rank + 1), 0]
            G.g.node.append(
                helper.make_node("Transpose", [ranked], [out], name=f"{n.name or out}/Transpose", perm=perm)
            )
        dropped += 1
    if dropped:
        _drop_dead(model)
        sort_topologically(model)
    return dropped


def _ids_rank(G: _Graph, name: str) -> int | None:
    """The rank of a graph input or typed value, else None."""
    for v in [*G.g.input, *G.g.value_info]:
        if v.name == name and v.type.tensor_type.HasField("shape"):
            return len(v.type.tensor_type.shape.dim)
    return None
