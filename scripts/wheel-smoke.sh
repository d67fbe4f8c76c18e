#!/usr/bin/env bash
# Build the wheel and use it as a user would: installed (not editable) into fresh venvs
# and run from outside the checkout.
#
#   1. pip install torch==2.13.0 "<wheel>[operator]": `pagedllm --version`; every module of
#      pagedllm.server, pagedllm.kernels and pagedllm.operator imports (from the venv, not
#      the checkout); `pagedllm serve` (the demo model) on a free loopback port until /ready
#      is 200, one completion with text, /version equal to --version, SIGTERM and exit 0;
#      `pagedllm operator --help`.
#   2. The operator image's install (Dockerfile, target `operator`): pip install --no-deps
#      <wheel> plus the `operator` extra's requirements. `pagedllm operator --help` and every
#      module of pagedllm.operator work, and torch is not installed.
#
# Usage: scripts/wheel-smoke.sh        (PYTHON=python3.11 to pick the interpreter)
# Any failing step fails the script; the server is stopped whatever happens.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python3}
TORCH_PIN=torch==2.13.0
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}
STOP_TIMEOUT_S=60
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pagedllm-wheel-smoke.XXXXXX")
server_pid=""

cleanup() {
  local rc=$?
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ]; then
    echo "wheel-smoke: FAILED (exit $rc)" >&2
    [ -f "$WORK/serve.log" ] && { echo "--- last lines of the server's log ---" >&2; tail -n 40 "$WORK/serve.log" >&2; }
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

step() { echo "wheel-smoke: $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

# -- build, from a copy of the files a build reads (the list the Dockerfile copies and
# tests/wheel_build.py checks), so a stale build/ folder of the checkout cannot leak in
step "building the wheel"
mkdir -p "$WORK/src"
(cd "$ROOT" && cp -R pyproject.toml setup.py README.md server kernels operator "$WORK/src/")
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/dist" "$WORK/src"
wheels=("$WORK"/dist/pagedllm-*.whl)
[ "${#wheels[@]}" -eq 1 ] && [ -f "${wheels[0]}" ] || {
  echo "wheel-smoke: expected one wheel, got: ${wheels[*]}" >&2
  exit 1
}
wheel=${wheels[0]}
version=$(basename "$wheel" | cut -d- -f2)
step "built $(basename "$wheel")"

cd "$WORK" # NOTE: outside the checkout from here on, so nothing imports from the source tree

# -- 1. the full install -----------------------------------------------------------------
step "pip install $TORCH_PIN \"$(basename "$wheel")[operator]\" into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install --quiet "$TORCH_PIN" "$wheel[operator]"
py="$WORK/venv/bin/python"
pagedllm="$WORK/venv/bin/pagedllm"

step "pagedllm --version"
printed=$("$pagedllm" --version)
echo "  $printed"
[ "$printed" = "pagedllm $version" ] || { echo "wheel-smoke: expected 'pagedllm $version'" >&2; exit 1; }

step "importing every module of pagedllm.server, pagedllm.kernels and pagedllm.operator"
"$py" - "$WORK/venv" <<'EOF'
import importlib, pkgutil, sys
from pathlib import Path

venv = Path(sys.argv[1]).resolve()
count = 0
for top in ("pagedllm.server", "pagedllm.kernels", "pagedllm.operator"):
    package = importlib.import_module(top)
    for path in package.__path__:
        assert Path(path).resolve().is_relative_to(venv), f"{top} comes from {path}, not from the venv"
    names = [top] + [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
    for name in names:
        importlib.import_module(name)
    count += len(names)
    print(f"  {top}: {len(names)} modules")
assert count > 60, f"only {count} modules: the wheel lacks subpackages"
EOF

port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "pagedllm serve (the demo model) on 127.0.0.1:$port"
"$pagedllm" serve --host 127.0.0.1 --port "$port" >"$WORK/serve.log" 2>&1 &
server_pid=$!

"$py" - "$port" "$server_pid" "$READY_TIMEOUT_S" "$version" <<'EOF'
import json, os, sys, time, urllib.error, urllib.request

port, pid, timeout, version = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
base = f"http://127.0.0.1:{port}"


def get(path):
    with urllib.request.urlopen(base + path, timeout=10) as response:
        return response.status, json.loads(response.read())


deadline = time.monotonic() + timeout
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before /ready")
    try:
        if get("/ready")[0] == 200:
            break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    if time.monotonic() > deadline:
        sys.exit(f"/ready not 200 within {timeout:.0f} s")
    time.sleep(1)
print(f"  /ready is 200 after {timeout - (deadline - time.monotonic()):.0f} s")

assert get("/version") == (200, {"version": version}), get("/version")
model = get("/v1/models")[1]["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "The for statement", "max_tokens": 16, "temperature": 0}).encode()
request = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=120) as response:
    completion = json.loads(response.read())
text = completion["choices"][0]["text"]
assert text.strip(), f"empty completion: {completion}"
print(f"  completion from {model}: {text!r}")
EOF

step "SIGTERM to the server"
kill -TERM "$server_pid"
stopped=1
for _ in $(seq "$STOP_TIMEOUT_S"); do
  if ! kill -0 "$server_pid" 2>/dev/null; then stopped=0; break; fi
  sleep 1
done
[ "$stopped" -eq 0 ] || { echo "wheel-smoke: the server did not stop within ${STOP_TIMEOUT_S} s of SIGTERM" >&2; exit 1; }
rc=0
wait "$server_pid" || rc=$?
server_pid=""
[ "$rc" -eq 0 ] || { echo "wheel-smoke: the server exited $rc after SIGTERM, not 0" >&2; exit 1; }
echo "  the server exited 0"

step "pagedllm operator --help"
"$pagedllm" operator --help >/dev/null

# -- 2. the operator image's install: no torch -------------------------------------------
step "pip install --no-deps the wheel and the operator extra's requirements into a fresh venv"
"$PYTHON" -m venv "$WORK/operator-venv"
opy="$WORK/operator-venv/bin/python"
"$WORK/operator-venv/bin/pip" install --quiet --no-deps "$wheel"
mapfile -t operator_requirements < <("$opy" - <<'EOF'
from importlib.metadata import requires

for line in requires("pagedllm"):
    requirement, _, marker = line.partition(";")
    if marker.strip() == 'extra == "operator"':
        print(requirement.strip())
EOF
)
[ "${#operator_requirements[@]}" -gt 0 ] || { echo "wheel-smoke: the wheel names no 'operator' extra" >&2; exit 1; }
echo "  ${operator_requirements[*]}"
"$WORK/operator-venv/bin/pip" install --quiet "${operator_requirements[@]}"

step "pagedllm operator --help without torch"
"$WORK/operator-venv/bin/pagedllm" operator --help >/dev/null
"$opy" - <<'EOF'
import importlib, importlib.util, pkgutil

import pagedllm.operator

assert importlib.util.find_spec("torch") is None, "torch is installed in the operator's venv"
names = [m.name for m in pkgutil.walk_packages(pagedllm.operator.__path__, "pagedllm.operator.")]
for name in names + ["pagedllm.server.config", "pagedllm.server.args", "pagedllm.server.entrypoints.cli"]:
    importlib.import_module(name)
print(f"  {len(names)} operator modules import; torch is not installed")
EOF

step "OK"
