# Settings shared by the shell tools (sourced by device_run.sh, ab_bench.sh and
# tile_sweep.sh). Every variable is optional:
#   OUT        folder for logs and reports (default: out/ under the current
#              directory; created)
#   WORK_DIR   scratch for the trees and builds of ab_bench.sh and tile_sweep.sh
#              (default: ${TMPDIR:-/tmp}/jflash-tools)
#   SITE_DIR   a folder of extra packages (pip install --target) put first on
#              PYTHONPATH, e.g. pytest and nvidia-cutlass on a machine whose
#              Python lacks them (default: none)
#   WHEEL_DIR  wheels that device_run.sh installs into SITE_DIR before its steps
#              (SITE_DIR then defaults to $WORK_DIR/site; default: none, nothing
#              is installed)
: "${OUT:=$PWD/out}"
: "${WORK_DIR:=${TMPDIR:-/tmp}/jflash-tools}"
if [ -n "${WHEEL_DIR:-}" ]; then : "${SITE_DIR:=$WORK_DIR/site}"; fi
: "${SITE_DIR:=}"
mkdir -p "$OUT" "$WORK_DIR"
export PYTHONPATH=$SITE_DIR${SITE_DIR:+${PYTHONPATH:+:}}${PYTHONPATH:-}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
