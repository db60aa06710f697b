#!/usr/bin/env bash
# The GPU suite, on the GPU machine (Python 3.12 with torch, numpy and pytest; no network), from the repository root
# with .whl/ carried along (scripts/fetch-gpu-wheels.sh fills it here): installs the wheels into a scratch directory,
# records the machine, runs the transfer benchmark (pdconnector.bench.gpu_transfer_bench, REPORT_DIR/bench/), every
# `pytest -m gpu` test, then e2e/gpu/demo.py when it exists, and writes REPORT_DIR/gpu-suite.json (counts, durations,
# exit codes, versions) next to the logs. Exits non-zero when anything failed or no test passed.
# PD_GPU_BENCH_ARGS: extra arguments for the benchmark (e.g. "--tokens 16384 --models qwen3-32b-tp8").
# Real vLLM: when scripts/gpu-vllm.sh installed it into PD_GPU_VLLM_DIR (default /tmp/pd-vllm), its activate.sh puts
# it on PYTHONPATH and points pdctl at that machine's site, and the step "vllm" runs the real-engine tests
# (tests/e2e/gpu/test_real_vllm.py: e2e/gpu/demo.py --engine vllm through the router).
# The step "connector" runs the connector's real-engine tests (tests/pdconnector/vllm: dense and hybrid, push and
# pull, the direct and the staged path, both layouts, failures, the router) with the engines on the GPU
# (PD_VLLM_TEST_DEVICE=cuda); PD_GPU_CONNECTOR_TESTS (files) and PD_GPU_CONNECTOR_K (pytest's -k) narrow them
# (each file runs in its own pytest, side by side with the others).
# The step "serving" runs the seed's serving benchmark with real engines on the GPU (e2e/bench/pd_bench.py: the
# Qwen3-32B KV twin, co-located vLLM, ours push and pull, upstream's connectors, QPS x input length through the
# router) into REPORT_DIR/serving; it starts no variant or run that would not end within its limit
# (PD_GPU_SERVING_TIMEOUT_S) and lists what ran and what was left out in REPORT_DIR/serving/points.json;
# PD_GPU_SERVING_ARGS replaces its sweep (variants, input lengths, QPS), so a sweep can be split across calls.
# The step "multi-turn" runs the multi-turn conversations benchmark with real engines on the GPU (e2e/bench/multi_turn.py:
# both roles' KV tiers off and on, side by side) into REPORT_DIR/multi-turn; PD_GPU_MULTI_TURN_ARGS adds arguments.
# PD_GPU_SUITE_STEPS: the steps to run, of "bench tests device demo connector vllm serving multi-turn" (default: the first
# four, "connector" and "vllm" too when vLLM is installed); one machine call holds ~10 minutes, so a call may run
# only some (e.g. "vllm").
#   usage: scripts/gpu-suite.sh REPORT_DIR
#   PD_GPU_SUITE_DEVICE=cpu runs the suite on host memory instead (see tests/pdconnector/worker/vram.py).
set -uo pipefail
if (($# != 1)); then
    echo "usage: $0 REPORT_DIR" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
mkdir -p "$1" && report=$(cd "$1" && pwd) || exit 2
python=${PYTHON:-python3}
# Wall-clock limits (s) that keep the whole run inside a 10-minute machine call, leaving time for the report.
bench_limit=${PD_GPU_BENCH_TIMEOUT_S:-180}
suite_limit=${PD_GPU_SUITE_TIMEOUT_S:-300}
demo_limit=${PD_GPU_DEMO_TIMEOUT_S:-90}
vllm_limit=${PD_GPU_VLLM_TIMEOUT_S:-480}
connector_limit=${PD_GPU_CONNECTOR_TIMEOUT_S:-540}
serving_limit=${PD_GPU_SERVING_TIMEOUT_S:-540}
multi_turn_limit=${PD_GPU_MULTI_TURN_TIMEOUT_S:-480}
serving_sweep=${PD_GPU_SERVING_ARGS:---variants ours-push,colocated,ours-pull,upstream-pull,upstream-push --input-lens 1024,4096,16384 --qps 1,2,4,8}
vllm_dir=${PD_GPU_VLLM_DIR:-/tmp/pd-vllm}
vllm_tests=tests/e2e/gpu/test_real_vllm.py
# shellcheck disable=SC2206 # PD_GPU_CONNECTOR_TESTS is a list of test files
connector_tests=(${PD_GPU_CONNECTOR_TESTS:-tests/pdconnector/vllm/test_connector_dense.py
    tests/pdconnector/vllm/test_connector_hybrid.py tests/pdconnector/vllm/test_connector_failures.py
    tests/pdconnector/vllm/test_router_over_engines.py tests/pdconnector/vllm/test_drain.py})
default_steps="bench tests device demo"
[[ -f $vllm_dir/activate.sh ]] && default_steps+=" connector vllm"
steps=" ${PD_GPU_SUITE_STEPS:-$default_steps} "
step() { [[ $steps == *" $1 "* ]]; }
scratch=$(mktemp -d /tmp/pd-gpu-suite.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
started=$(date +%s)

limited() { # limited SECONDS COMMAND...: the command, ended at the limit (124), then whatever it left running
    local seconds=$1
    shift
    "$python" "$root/scripts/run_reaped.py" "$seconds" "$@"
}

echo "== install (.whl -> $scratch)"
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$scratch" "${wheels[@]}" 2>&1 |
        tee "$report/install.log"
    install_rc=${PIPESTATUS[0]}
else
    echo "no wheels in .whl/: run scripts/fetch-gpu-wheels.sh on the CPU machine and carry .whl along" | tee "$report/install.log"
    install_rc=1
fi
if [[ -f $vllm_dir/activate.sh ]]; then
    # vLLM's scratch install and the machine's site (pdctl reads PDCTL_SITE); ours first below: same pins.
    # shellcheck disable=SC1091
    . "$vllm_dir/activate.sh"
    echo "vLLM from $vllm_dir (site $PDCTL_SITE)" | tee -a "$report/install.log"
elif step vllm || step connector; then
    echo "no vLLM in $vllm_dir: run scripts/gpu-vllm.sh $vllm_dir first (scripts/fetch-gpu-vllm.sh lists the calls)" |
        tee -a "$report/install.log"
fi
export PYTHONPATH="$scratch:$root/connector:$root/operator${PYTHONPATH:+:$PYTHONPATH}"
# The project runs from its source folders there, not installed: give it the distribution metadata it reads its
# version from (pdoperator.render.defaults), as an editable install would.
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | awk 'NR == 1')
mkdir -p "$scratch/pd_operator-$version.dist-info"
printf 'Metadata-Version: 2.1\nName: pd-operator\nVersion: %s\n' "$version" >"$scratch/pd_operator-$version.dist-info/METADATA"
export PD_GPU_SUITE_LOG_DIR="$report/engine-logs"

echo "== machine"
{ nvidia-smi || echo "nvidia-smi: not available"; } 2>&1 | tee "$report/nvidia-smi.txt"
"$python" - "$report/versions.json" <<'EOF' 2>&1 | tee "$report/versions.log"
import importlib.metadata, json, platform, sys

versions = {"python": platform.python_version()}
for dist in ("torch", "numpy", "pytest", "nixl", "nixl-cu13", "msgspec", "pydantic", "vllm"):
    try:
        versions[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        versions[dist] = None
try:
    import torch

    versions["torch_cuda"] = torch.version.cuda
    versions["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as error:  # the report says what is missing instead of stopping here
    versions["torch_error"] = f"{type(error).__name__}: {error}"
try:
    import nixl._api  # noqa: F401
except Exception as error:
    versions["nixl_error"] = f"{type(error).__name__}: {error}"
json.dump(versions, open(sys.argv[1], "w"), indent=2)
print(json.dumps(versions))
EOF

echo "== transfer benchmark"
bench_rc=""
if ((install_rc == 0)) && step bench; then
    # shellcheck disable=SC2086 # PD_GPU_BENCH_ARGS is a list of arguments
    limited "$bench_limit" "$python" -m pdconnector.bench.gpu_transfer_bench "$report/bench" ${PD_GPU_BENCH_ARGS:-} 2>&1 | tee "$report/bench.log"
    bench_rc=${PIPESTATUS[0]}
fi

echo "== gpu tests"
# Only the files holding gpu tests: vLLM is not installed here, and modules importing it must not be collected.
# The real-engine tests are their own step (minutes of engine start-up).
mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | grep -vxF "$vllm_tests" | sort)
printf '%s\n' "${files[@]}" | tee "$report/gpu-test-files.txt"
pytest_rc=""
if ((install_rc == 0 && ${#files[@]})) && step tests; then
    limited "$suite_limit" "$python" -m pytest -m gpu -v -p no:cacheprovider --durations=10 --junitxml="$report/gpu-suite.xml" "${files[@]}" 2>&1 |
        tee "$report/pytest.log"
    pytest_rc=${PIPESTATUS[0]}
fi

echo "== device-id tests"
# Host-memory tests of ranks on devices other than 0 (descriptors, region tables, the worker's device binding and
# transfers between ranks labelled cuda:3.. and cuda:5..): this machine has one GPU, so they stand in for cuda:N > 0.
device_rc=""
if ((install_rc == 0)) && step device; then
    limited 120 "$python" -m pytest -v -p no:cacheprovider -k "device" --junitxml="$report/device-ids.xml" \
        tests/pdconnector/layout/test_plan.py tests/pdconnector/layout/test_descriptors.py tests/pdconnector/transport/test_descriptors.py \
        tests/pdconnector/worker/test_devices.py tests/pdconnector/worker/test_transfers.py 2>&1 | tee "$report/device-ids.log"
    device_rc=${PIPESTATUS[0]}
fi

demo_rc=""
if [[ -f e2e/gpu/demo.py ]] && step demo; then
    echo "== e2e/gpu/demo.py"
    limited "$demo_limit" "$python" e2e/gpu/demo.py "$report" 2>&1 | tee "$report/demo.log"
    demo_rc=${PIPESTATUS[0]}
fi

connector_rc=""
if ((install_rc == 0)) && step connector; then
    echo "== the connector on real vLLM engines on the GPU (${connector_tests[*]}), one pytest per file side by side"
    # Each engine has a fixed KV cache on the GPU (tests/pdconnector/vllm/engine_device.py), so the files' engines
    # start side by side: the step takes as long as its longest file, not their sum.
    connector_pids=()
    for file in "${connector_tests[@]}"; do
        name=$(basename "$file" .py)
        PD_VLLM_TEST_DEVICE=cuda limited "$connector_limit" "$python" -m pytest -v -rs -p no:cacheprovider --durations=10 \
            --junitxml="$report/connector-$name.xml" ${PD_GPU_CONNECTOR_K:+-k "$PD_GPU_CONNECTOR_K"} "$file" \
            >"$report/connector-$name.log" 2>&1 &
        connector_pids+=($!)
    done
    connector_rc=0
    for pid in "${connector_pids[@]}"; do
        wait "$pid"
        rc=$?
        # pytest's 5 (nothing collected) is fine for a file that -k leaves empty
        ((rc == 0 || rc == 5 || connector_rc != 0)) || connector_rc=$rc
    done
    tail -n 3 "$report"/connector-*.log
fi

vllm_rc=""
if ((install_rc == 0)) && step vllm; then
    echo "== real vLLM ($vllm_tests)"
    limited "$vllm_limit" "$python" -m pytest -m gpu -v -rs -p no:cacheprovider --junitxml="$report/vllm.xml" "$vllm_tests" 2>&1 |
        tee "$report/vllm.log"
    vllm_rc=${PIPESTATUS[0]}
    # The demo's figures next to the summary (its engine logs and state sit deeper than a report should).
    cp "$PD_GPU_SUITE_LOG_DIR/real-vllm/gpu-demo.json" "$report/vllm-demo.json" 2>/dev/null
fi

serving_rc=""
if step serving && [[ -z ${PDCTL_SITE:-} ]]; then
    echo "== the serving benchmark needs vLLM on this machine: run scripts/gpu-vllm.sh $vllm_dir first" | tee "$report/serving.log"
    serving_rc=1
elif ((install_rc == 0)) && step serving; then
    echo "== the serving benchmark with real engines on the GPU (e2e/bench/pd_bench.py $serving_sweep)"
    # The site's GPU share suits tests (a tiny model, engines beside them); here the engines get most of the GPU,
    # so decode's KV cache holds the sweep's longest prompts several times over.
    sed "s/^PDCTL_GPU_MEMORY_FRACTION=.*/PDCTL_GPU_MEMORY_FRACTION=${PD_GPU_SERVING_MEMORY_FRACTION:-0.6}/" \
        "$PDCTL_SITE" >"$scratch/serving-site.env"
    # shellcheck disable=SC2086 # the sweep is a list of arguments
    PDCTL_SITE="$scratch/serving-site.env" limited "$serving_limit" "$python" e2e/bench/pd_bench.py --engine vllm --spec examples/tiny-gpu-vllm.yaml \
        --model-kind qwen3-32b-kv-twin --output-len 128 --seconds 8 --min-prompts 8 --drain-s 8 --warmup-requests 4 --out "$report/serving" \
        --budget-s $((serving_limit - 30)) $serving_sweep 2>&1 | tee "$report/serving.log"
    serving_rc=${PIPESTATUS[0]}
    rm -rf "$report/serving"/tiny-model-* # the twin's weights (~0.5 GB), written there again in seconds
fi

multi_turn_rc=""
if step multi-turn && [[ -z ${PDCTL_SITE:-} ]]; then
    echo "== the multi-turn benchmark needs vLLM on this machine: run scripts/gpu-vllm.sh $vllm_dir first" | tee "$report/multi-turn.log"
    multi_turn_rc=1
elif ((install_rc == 0)) && step multi-turn; then
    echo "== the multi-turn benchmark with real engines on the GPU (e2e/bench/multi_turn.py)"
    # shellcheck disable=SC2086 # PD_GPU_MULTI_TURN_ARGS is a list of arguments
    limited "$multi_turn_limit" "$python" e2e/bench/multi_turn.py --spec examples/tiny-gpu-vllm.yaml --out "$report/multi-turn" \
        ${PD_GPU_MULTI_TURN_ARGS:-} 2>&1 | tee "$report/multi-turn.log"
    multi_turn_rc=${PIPESTATUS[0]}
    rm -rf "$report/multi-turn"/tiny-model-* # the model's weights, written there again in seconds
fi

echo "== summary ($report/gpu-suite.json)"
"$python" - "$report" "$install_rc" "$pytest_rc" "$demo_rc" "$(($(date +%s) - started))" "$device_rc" "$bench_rc" "$vllm_rc" "$steps" "$connector_rc" "$serving_rc" "$multi_turn_rc" <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET
from pathlib import Path

report, install_rc, pytest_rc, demo_rc, wall_s = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
device_rc, bench_rc, vllm_rc, steps, connector_rc = sys.argv[6], sys.argv[7], sys.argv[8], sys.argv[9].split(), sys.argv[10]
serving_rc, multi_turn_rc = sys.argv[11], sys.argv[12]


def code(value):  # an exit code; empty: that step did not run
    return int(value) if value else None


def parsed(value):  # a record_property value: JSON where it is (numbers), else the string
    try:
        return json.loads(value)
    except ValueError:
        return value


def junit_summary(junit):  # counts and per-case entries of one pytest junit file
    tests = {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "duration_s": 0.0}
    cases = []
    if not junit.exists():
        return tests, cases
    root = ET.parse(junit).getroot()
    for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
        for key, attribute in (("total", "tests"), ("failed", "failures"), ("errors", "errors"), ("skipped", "skipped")):
            tests[key] += int(suite.get(attribute, 0))
        tests["duration_s"] += float(suite.get("time", 0))
        for case in suite.iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            entry = {"test": case.get("name"), "outcome": outcome, "time_s": float(case.get("time", 0))}
            entry |= {p.get("name"): parsed(p.get("value")) for p in case.iter("property")}
            cases.append(entry)
    tests["passed"] = tests["total"] - tests["failed"] - tests["errors"] - tests["skipped"]
    tests["duration_s"] = round(tests["duration_s"], 1)
    return tests, cases


tests, cases = junit_summary(report / "gpu-suite.xml")
device_tests, _ = junit_summary(report / "device-ids.xml")
vllm_tests, vllm_cases = junit_summary(report / "vllm.xml")
connector_tests, connector_cases = {}, []
for junit in sorted(report.glob("connector-*.xml")):  # one file per test file, run side by side
    counts, file_cases = junit_summary(junit)
    connector_tests = {key: round(connector_tests.get(key, 0) + value, 1) for key, value in counts.items()}
    connector_cases += file_cases
versions_file = report / "versions.json"
summary = {
    "ok": False,
    "device": os.environ.get("PD_GPU_SUITE_DEVICE", "cuda"),
    "tests": tests,
    "steps": steps,
    "device_id_tests": device_tests,
    "vllm_tests": vllm_tests,  # real engines (tests/e2e/gpu/test_real_vllm.py); skipped: no CUDA or no vLLM
    "connector_tests": connector_tests,  # the connector's real-engine tests with the engines on the GPU
    "install_exit_code": install_rc,
    "pytest_exit_code": code(pytest_rc),
    "device_id_exit_code": code(device_rc),
    "demo_exit_code": code(demo_rc),  # null: e2e/gpu/demo.py does not exist
    "bench_exit_code": code(bench_rc),
    "vllm_exit_code": code(vllm_rc),
    "connector_exit_code": code(connector_rc),
    "serving_exit_code": code(serving_rc),  # e2e/bench/pd_bench.py on real engines (REPORT_DIR/serving)
    "multi_turn_exit_code": code(multi_turn_rc),  # e2e/bench/multi_turn.py on real engines (REPORT_DIR/multi-turn)
    "wall_s": wall_s,
    "versions": json.loads(versions_file.read_text()) if versions_file.exists() else None,
}
# Every step asked for ran and passed (demo: when the file exists); the pytest steps passed at least one test.
summary["ok"] = (
    install_rc == 0
    and ("tests" not in steps or (code(pytest_rc) == 0 and tests["passed"] > 0))
    and ("device" not in steps or code(device_rc) == 0)
    and code(demo_rc) in (None, 0)
    and ("bench" not in steps or code(bench_rc) == 0)
    and ("vllm" not in steps or (code(vllm_rc) == 0 and vllm_tests["passed"] > 0))
    and ("connector" not in steps or (code(connector_rc) == 0 and connector_tests.get("passed", 0) > 0))
    and ("serving" not in steps or code(serving_rc) == 0)
    and ("multi-turn" not in steps or code(multi_turn_rc) == 0)
)
(report / "gpu-suite.json").write_text(
    json.dumps(summary | {"cases": cases + vllm_cases + connector_cases}, indent=2) + "\n"
)
print(json.dumps(summary))
sys.exit(0 if summary["ok"] else 1)
EOF
