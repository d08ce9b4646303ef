#!/usr/bin/env bash
# One command for a lent GPU (one H100 / H200, fresh machine, maybe offline): set up, run the kernel tests
# compiled (bf16 included), the kernel benchmark and the GPU check with its calibration, within about 8 minutes,
# and keep everything in one results folder.
#
#   bash bench/gpu_all.sh [--dry-run] [--out DIR] [--tar FILE.tar.gz]        (or: make gpu-all)
#
# Steps, each under its own timeout (seconds, x 3 in a dry run; GPU_ALL_T_<STEP> overrides; 75 + 150 + 60 + 180 =
# 465 s of work):
#   setup      (75)  import what the steps need; only if something is missing, pip install -e ".[dev]" (needs the
#                    network; pyproject's torch>=2.4 keeps the machine's CUDA torch)
#   tests      (150) the kernel tests compiled (TRITON_INTERPRET unset), pytest-xdist workers when installed
#   bench      (60)  python -m bench --only kernels --quick (Triton vs references and the fair baselines)
#   calibrate  (180) python -m bench.gpu_check --tokens 4096: correctness and timing rows, baselines at 16 / 256 /
#                    4,096 / 16,384 tokens, and conf/hardware/measured/<gpu>.yaml, which the simulator merges
# A failing or timed-out step is recorded and the next one still runs; the exit status is 1 when any step
# failed, 2 for a bad command line. Results: DIR (default bench/results/gpu_all/<machine>-<UTC time>/) holds
# manifest.json (machine, commit, each step's command, status, seconds, log), <step>.log and each step's files.
# --dry-run rehearses every step on the CPU: imports only (no pip), tests collected but not run (Triton runs only
# interpreted here), bench on the CPU references, gpu_check --dry-run (its rehearsal calibration file stays under
# DIR). GPU_ALL_STEPS="setup calibrate" runs a subset (in that order). --tar packs DIR into one archive at the end
# (for a lent machine that hands back only a few files, e.g. --tar "$OUT/gpu_all.tar.gz").
set -u
DRY=0
OUT=""
TAR=""
usage="usage: bash bench/gpu_all.sh [--dry-run] [--out DIR] [--tar FILE.tar.gz]"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) [ $# -ge 2 ] || { echo "bench/gpu_all.sh: --out needs a directory; $usage" >&2; exit 2; }; OUT=$2; shift ;;
    --tar) [ $# -ge 2 ] || { echo "bench/gpu_all.sh: --tar needs a file name; $usage" >&2; exit 2; }; TAR=$2; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "bench/gpu_all.sh: unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
  shift
done
case "$OUT" in ""|/*) ;; *) OUT="$PWD/$OUT" ;; esac  # --out and --tar are relative to where the command was run
case "$TAR" in ""|/*) ;; *) TAR="$PWD/$TAR" ;; esac
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
STEPS=${GPU_ALL_STEPS:-setup tests bench calibrate}
for s in $STEPS; do
  case "$s" in setup|tests|bench|calibrate) ;; *)
    echo "bench/gpu_all.sh: GPU_ALL_STEPS names unknown step '$s'; choose from setup tests bench calibrate." >&2; exit 2 ;;
  esac
done

# the Python whose torch sees the GPU: $PYTHON, else the project's .venv when it does (or in a dry run), else python3
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ] && { [ $DRY = 1 ] || .venv/bin/python -c \
    "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }; then PY=.venv/bin/python
else PY=python3; fi
command -v "$PY" >/dev/null 2>&1 || { echo "bench/gpu_all.sh: no Python at '$PY'; set PYTHON=/path/to/python." >&2; exit 2; }
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $DRY = 0 ]; then  # a torch without CUDA is refused here; a missing torch is setup's to install
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" >/dev/null 2>&1
  if [ $? = 3 ]; then
    echo "bench/gpu_all.sh: torch in $PY sees no CUDA device; run it on a GPU machine (PYTHON=... picks another" \
      "Python) or rehearse it with --dry-run." >&2
    exit 2
  fi
fi

if [ $DRY = 1 ]; then MACHINE=cpu-dry-run
else
  MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr 'A-Z' 'a-z' \
            | sed -e 's/^nvidia //' -e 's/[^a-z0-9]\+/-/g' -e 's/^-//' -e 's/-$//')
  MACHINE=${MACHINE:-unknown-gpu}
fi
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
RESULTS=${OUT:-bench/results/gpu_all/$MACHINE-$(date -u +%Y%m%dT%H%M%SZ)}
if [ -e "$RESULTS" ] && [ -n "$(ls -A "$RESULTS" 2>/dev/null)" ]; then
  echo "bench/gpu_all.sh: $RESULTS exists and is not empty; pass another --out (results are never overwritten)." >&2
  exit 2
fi
mkdir -p "$RESULTS" || { echo "bench/gpu_all.sh: cannot create $RESULTS; pass a writable --out." >&2; exit 2; }
RECORDS="$RESULTS/.steps.tsv"
: >"$RECORDS"
KERNEL_TESTS="tests/test_kernels_gemm.py tests/test_kernels_gating.py tests/test_kernels_dispatch.py
  tests/test_kernels_shuffle.py tests/test_kernels_layer.py"
# what every step imports: a missing one is what setup installs
IMPORTS="import torch, triton, numpy, yaml, pytest, hypothesis
import repro.kernels.grouped_gemm, repro.kernels.shuffle, repro.systems.semmoe, repro.sim.hardware
import bench.bench_kernels, bench.gpu_check"

step_setup() {
  if [ $DRY = 0 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
      echo "torch in $PY sees no CUDA device; a GPU run needs the machine's CUDA torch (set PYTHON=...)"; return 3; }
  fi
  if "$PY" -c "$IMPORTS"; then echo "everything the steps import is installed: nothing to install"
  elif [ $DRY = 1 ]; then echo "dry run: something above is missing and a dry run installs nothing"; return 1
  else
    echo "installing the project and its dev extras (the installed CUDA torch satisfies torch>=2.4 and stays)"
    "$PY" -m pip install -q --retries 1 --timeout 15 -e ".[dev]" || echo "pip install failed (offline?)"
    "$PY" -c "$IMPORTS" || return 1
  fi
  "$PY" -c "import torch, triton, platform; print('python', platform.python_version(), 'torch', torch.__version__,
    'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
}

step_tests() {
  if [ $DRY = 1 ]; then
    echo "dry run: collecting the kernel tests only (Triton runs only interpreted on a CPU; make test runs them)"
    "$PY" -m pytest -q -p no:cacheprovider --collect-only $KERNEL_TESTS
    return
  fi
  local parallel=""
  "$PY" -c "import xdist" 2>/dev/null && parallel="-n 8"  # compile kernels on 8 CPUs at once
  env -u TRITON_INTERPRET "$PY" -m pytest -q -rs -p no:cacheprovider $parallel \
    --junitxml="$RESULTS/tests/junit.xml" $KERNEL_TESTS
}

step_bench() {
  "$PY" -m bench --only kernels --quick --out "$RESULTS/bench"
}

step_calibrate() {
  if [ $DRY = 1 ]; then "$PY" -m bench.gpu_check --dry-run --out "$RESULTS/gpu_check"
  else env -u TRITON_INTERPRET "$PY" -m bench.gpu_check --tokens 4096 --out "$RESULTS/gpu_check"; fi
}

export PY DRY RESULTS KERNEL_TESTS IMPORTS
export -f step_setup step_tests step_bench step_calibrate
FAILED=0
SLOW=$((DRY == 1 ? 3 : 1))
for s in $STEPS; do
  # a dry run shares a small CPU with other work: three times the GPU machine's default timeouts
  case "$s" in setup) t=${GPU_ALL_T_SETUP:-$((75 * SLOW))} ;; tests) t=${GPU_ALL_T_TESTS:-$((150 * SLOW))} ;;
    bench) t=${GPU_ALL_T_BENCH:-$((60 * SLOW))} ;; calibrate) t=${GPU_ALL_T_CALIBRATE:-$((180 * SLOW))} ;; esac
  echo "== $s (timeout $t s) -> $RESULTS/$s.log"
  began=$(date +%s%N)
  # timeout signals the step's whole process group (pytest workers, all-to-all ranks) when the time is up
  timeout -k 10 "$t" bash -c "step_$s" >"$RESULTS/$s.log" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - began) / 1000000 ))
  seconds=$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))
  tail -n 3 "$RESULTS/$s.log" | sed 's/^/   /'
  if [ $rc = 0 ]; then status=ok; elif [ $rc = 124 ] || [ $rc = 137 ]; then status=timed_out; else status=failed; fi
  [ $rc = 0 ] || FAILED=1
  echo "   $s: $status (rc $rc, ${seconds} s)"
  printf '%s\t%s\t%s\t%s\t%s\n' "$s" "$status" "$rc" "$seconds" "$t" >>"$RECORDS"
done

# manifest.json (written whole, then renamed): where, what, how each step went, which files it left
"$PY" - "$RESULTS" "$RECORDS" "$MACHINE" "$STARTED" "$DRY" "$FAILED" <<'EOF' || { echo "manifest failed" >&2; FAILED=1; }
import datetime as dt, json, os, platform, subprocess, sys
from pathlib import Path

results, records, machine, started, dry, failed = sys.argv[1:]
results = Path(results)
commands = {
    "setup": "import check; pip install -e .[dev] only when something is missing (not in a dry run)",
    "tests": "pytest --collect-only <kernel tests>" if dry == "1" else "env -u TRITON_INTERPRET pytest <kernel tests>",
    "bench": "python -m bench --only kernels --quick",
    "calibrate": "python -m bench.gpu_check --dry-run" if dry == "1" else "python -m bench.gpu_check --tokens 4096",
}

def run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None

steps = []
for line in Path(records).read_text().splitlines():
    name, status, rc, seconds, timeout = line.split("\t")
    folder = results / name if name != "calibrate" else results / "gpu_check"
    files = sorted(str(p.relative_to(results)) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
    steps.append({"step": name, "status": status, "rc": int(rc), "seconds": round(float(seconds), 1),
                  "timeout_s": int(timeout), "command": commands[name], "log": f"{name}.log", "files": files})
manifest = {
    "machine": machine, "dry_run": dry == "1", "ok": failed == "0", "started_utc": started,
    "finished_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "seconds": round(sum(s["seconds"] for s in steps), 1), "budget_s": 480,
    "host": platform.node(), "gpus": run("nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"),
    "commit": run("git", "rev-parse", "HEAD"), "dirty_files": len((run("git", "status", "--porcelain") or "").splitlines()),
    "python": sys.executable, "steps": steps,
}
tmp = results / ".manifest.json.tmp"
tmp.write_text(json.dumps(manifest, indent=1) + "\n")
os.replace(tmp, results / "manifest.json")
os.remove(records)
print(f"manifest -> {results / 'manifest.json'}: " + ", ".join(f"{s['step']} {s['status']}" for s in steps)
      + f"; {manifest['seconds']} s")
EOF
if [ -n "$TAR" ]; then
  tar -czf "$TAR" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" && echo "archive -> $TAR" \
    || { echo "bench/gpu_all.sh: could not write the archive $TAR" >&2; FAILED=1; }
fi
exit $FAILED
