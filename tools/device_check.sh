#!/usr/bin/env bash
# The checks that need a GPU or idle cores, as one bounded run (docs/performance.md, "On a machine
# with cores to spare"; docs/torch_backend.md, "CUDA tensors"). Each part has its own time limit,
# and one part failing does not stop the next. Run from the repository root, as root for the
# emulated cluster; results and logs go to $OUT (default: a new temporary folder).
#
#   OUT=results bash tools/device_check.sh [parts...]     parts: cuda threads emulate (default all)
#
# PYTHON: the interpreter (default python3); DEVTOOLS: a folder with setuptools for the build, if
# the machine's is too old; PYSPY: py-spy's path, to profile one worker (threads part).
set -u
OUT=${OUT:-$(mktemp -d)}
WORK=$(mktemp -d)  # every result file, packed into $OUT/device-check.tgz after each part
PYTHON=${PYTHON:-python3}
PARTS=${*:-cuda threads emulate}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

say() { echo "== $(date -u +%H:%M:%S) $*"; }
pack() { tar czf "$OUT/device-check.tgz" -C "$WORK" . ; }
wants() { [[ " $PARTS " == *" $1 "* ]]; }

say "machine: $(nproc) cores, $(uname -r)"
command -v nvidia-smi > /dev/null && nvidia-smi -L
"$PYTHON" -c 'import sys, numpy, torch; print(sys.version.split()[0], "numpy", numpy.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'

say "install (editable, with the compiled plane)"
install() { REDSRV_NATIVE_STRICT=1 "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . ; }
# A machine with no network and a setuptools older than pyproject.toml's floor builds with one
# carried beside the checkout (DEVTOOLS: a folder holding setuptools, put on the path for the build).
install > "$OUT/install.log" 2>&1 || { [ -n "${DEVTOOLS:-}" ] && PYTHONPATH="$DEVTOOLS" install >> "$OUT/install.log" 2>&1; } \
    || { tail -20 "$OUT/install.log"; exit 1; }
"$PYTHON" -c 'from redsrv.core import plane; print("compiled plane:", plane.native_unavailable() or "built")'

if wants cuda; then
    say "DDP on CUDA tensors: the redsrv hook against gloo and NCCL"
    timeout 300 "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/adapters/torch/test_cuda_hook.py 2>&1 | tee "$WORK/cuda.log" | tail -15
    pack
fi

if wants threads; then
    # A worker's client I/O threads, 1 -> 2 -> 4, beside eight reducers (with four, the reducers
    # were the limit for two workers and may be for one: docs/performance.md). Two alternated rounds.
    for round in 1 2; do
        for workers in 1 2; do
            for threads in 1 2 4; do
                name="threads-w${workers}-k${threads}-r${round}"
                say "bench local --workers $workers --reducers 8 --io-threads $threads (round $round)"
                timeout 120 "$PYTHON" -c "import sys; from redsrv.cli import main; sys.exit(main())" bench local --workers "$workers" \
                    --reducers 8 --sizes 64 --reps 40 --io-threads "$threads" --json "$WORK/$name.json" 2>&1 | tail -1
                pack
            done
        done
    done
    # Where one worker's threads and GIL go at k = 4, where py-spy is at hand (PYSPY: its path).
    if [ -x "${PYSPY:-}" ]; then
        say "py-spy on one worker at k = 4"
        # SIGINT at the limit: the benchmark's own cleanup then stops its reducers and worker.
        timeout -s INT 180 "$PYTHON" -c "import sys; from redsrv.cli import main; sys.exit(main())" bench local --workers 1 \
            --reducers 8 --sizes 64 --reps 900 --io-threads 4 > "$WORK/profile-run.log" 2>&1 &
        bench=$!
        worker=""
        for _ in $(seq 300); do worker=$(pgrep -f "redsrv.bench.local worker" | head -1); [ -n "$worker" ] && break; sleep 0.1; done
        if [ -n "$worker" ]; then
            timeout 30 "$PYSPY" record --gil --threads -r 250 -d 6 -f raw -o "$WORK/profile-gil-k4.txt" -p "$worker" > /dev/null 2>&1
            timeout 30 "$PYSPY" record --threads -r 250 -d 6 -f raw -o "$WORK/profile-all-k4.txt" -p "$worker" > /dev/null 2>&1
        fi
        wait "$bench"
        pack
    fi
    say "redsrv plan --measure"
    timeout 120 "$PYTHON" -c "import sys; from redsrv.cli import main; sys.exit(main())" plan --measure --workers 16 --worker-gbit 100 --reducer-gbit 100 2>&1 | tee "$WORK/plan.log" | tail -25
    pack
fi

if wants emulate; then
    if command -v ip > /dev/null && command -v tc > /dev/null; then
        # The three emulated targets (n=4 at 1 Gbit/s, n=8 at 400 Mbit/s, no rate limit),
        # here with a core or more per emulated host.
        for config in "4 1gbit" "8 400mbit" "4 none"; do
            set -- $config
            say "bench emulate --workers $1 --sizes 64 --rounds 2 --rate $2"
            timeout 200 "$PYTHON" -c "import sys; from redsrv.cli import main; sys.exit(main())" bench emulate --workers "$1" --sizes 64 --rounds 2 --rate "$2" \
                --out "$WORK/emulate-n$1-$2" 2>&1 | tee "$WORK/emulate-n$1-$2.log" | tail -12
            pack
        done
    else
        say "emulate skipped: no iproute2 (ip, tc) here"
    fi
fi
say "done"
