#!/usr/bin/env bash
# Fetch the ONNX Runtime C/C++ headers (Debian's libonnxruntime-dev) and nlohmann-json (nlohmann-json3-dev) into
# .third_party/ for the C++ runtime in edgeattn/runtimes/cpp. The pip wheel ships libonnxruntime.so but no headers;
# headers older than the runtime work with it (the C API is append-only and versioned).
#
# Nothing is installed: the packages are downloaded with `apt-get download` through a private apt configuration
# (this machine's own Debian sources with the suite rewritten, private lists and cache) and unpacked with
# `dpkg-deb -x`. Once the headers are there, running it again does nothing.
#
# Suites: nlohmann-json3-dev comes from $SUITE (trixie, stable). libonnxruntime-dev comes from $ORT_SUITE (forky,
# Debian testing: ONNX Runtime 1.23 headers) because trixie's 1.21 headers predate Ort::Allocator::GetStats, which
# the example uses to report the allocator's peak bytes. ORT_SUITE=trixie works too; memory stats are then
# reported as unavailable.
#
#   bash scripts/fetch_onnxruntime_headers.sh     # -> .third_party/debian/usr/include/{onnxruntime,nlohmann}
#   EDGEATTN_THIRD_PARTY=/some/dir ORT_SUITE=trixie bash scripts/fetch_onnxruntime_headers.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${EDGEATTN_THIRD_PARTY:-$ROOT/.third_party}"
SUITE="${SUITE:-trixie}"
ORT_SUITE="${ORT_SUITE:-forky}"
PREFIX="$DEST/debian"            # dpkg-deb -x target: headers land in $PREFIX/usr/include
STAMP="$PREFIX/.fetched"
WANT="libonnxruntime-dev/$ORT_SUITE nlohmann-json3-dev/$SUITE"

if [[ -f "$STAMP" && "$(head -n1 "$STAMP")" == "$WANT" \
      && -f "$PREFIX/usr/include/onnxruntime/onnxruntime_cxx_api.h" && -f "$PREFIX/usr/include/nlohmann/json.hpp" ]]; then
    echo "headers already in $PREFIX/usr/include ($(tail -n1 "$STAMP"))"
    exit 0
fi

die() { echo "fetch_onnxruntime_headers: $*" >&2; exit 1; }
command -v apt-get >/dev/null || die "apt-get not found: set ONNXRUNTIME_ROOT to an official ONNX Runtime release instead"
command -v dpkg-deb >/dev/null || die "dpkg-deb not found"

CODENAME="$( . /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}" )"
[[ -n "$CODENAME" ]] || die "cannot read VERSION_CODENAME from /etc/os-release"
SUITES="$SUITE"
[[ "$ORT_SUITE" == "$SUITE" ]] || SUITES="$SUITE $ORT_SUITE"

APT="$DEST/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/debs" "$APT/sources.list.d"
rm -f "$APT/sources.list.d/"*

# Every source of this machine that serves its release's main suite (not -updates/-security), with the suite
# replaced by ours: same mirror, components and keyring.
for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    awk -v cn="$CODENAME" -v suites="$SUITES" '
        BEGIN { RS = ""; FS = "\n" }
        {
            keep = 0; out = ""
            for (i = 1; i <= NF; i++) {
                line = $i
                if (line ~ /^Suites:/) {
                    n = split(substr(line, 8), s, /[ \t]+/)
                    for (j = 1; j <= n; j++) if (s[j] == cn) keep = 1
                    line = "Suites: " suites
                }
                out = out line "\n"
            }
            if (keep) printf "%s\n", out
        }' "$f" > "$APT/sources.list.d/$(basename "$f")"
done
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f "$f" ]] || continue
    awk -v cn="$CODENAME" -v suites="$SUITES" '
        $1 == "deb" {
            i = 2
            if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }   # skip [options]
            if ($(i + 1) != cn) next
            n = split(suites, s, " ")
            for (j = 1; j <= n; j++) { $(i + 1) = s[j]; print }
        }' "$f" > "$APT/sources.list.d/$(basename "$f" .list)-derived.list"
done
find "$APT/sources.list.d" -type f -empty -delete
[[ -n "$(ls -A "$APT/sources.list.d")" ]] || die "no apt source for '$CODENAME' in /etc/apt to derive a '$SUITES' source from"

APT_OPTS=(
    -o "Dir::Etc::SourceList=/dev/null"
    -o "Dir::Etc::SourceParts=$APT/sources.list.d"
    -o "Dir::State::Lists=$APT/lists"
    -o "Dir::Cache=$APT/cache"
    -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
    -o "APT::Sandbox::User=root"
    -o "Acquire::Languages=none"
    -o "Debug::NoLocking=1"
)
echo "apt-get update ($SUITES, private lists in $APT)"
apt-get "${APT_OPTS[@]}" -qq update || die "apt-get update for $SUITES failed (is a Debian mirror reachable?)"
# shellcheck disable=SC2086
(cd "$APT/debs" && rm -f ./*.deb && apt-get "${APT_OPTS[@]}" -qq download $WANT) || die "apt-get download $WANT failed"

rm -rf "$PREFIX"
mkdir -p "$PREFIX"
versions=()
for deb in "$APT/debs/"*.deb; do
    dpkg-deb -x "$deb" "$PREFIX"
    versions+=("$(dpkg-deb -f "$deb" Package)=$(dpkg-deb -f "$deb" Version)")
done
[[ -f "$PREFIX/usr/include/onnxruntime/onnxruntime_cxx_api.h" ]] \
    || die "libonnxruntime-dev has no usr/include/onnxruntime/onnxruntime_cxx_api.h"
[[ -f "$PREFIX/usr/include/nlohmann/json.hpp" ]] || die "nlohmann-json3-dev has no usr/include/nlohmann/json.hpp"
printf '%s\n%s\n' "$WANT" "${versions[*]}" > "$STAMP"
echo "headers in $PREFIX/usr/include (${versions[*]})"
