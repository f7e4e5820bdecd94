#!/usr/bin/env bash
# Build the C core with AddressSanitizer + UndefinedBehaviorSanitizer and run the
# whole test suite under them. Usage: scripts/test-sanitized.sh [pytest args]
# (The extension is rebuilt in place; `python setup.py build_ext --inplace` restores a normal build.)
set -euo pipefail
cd "$(dirname "$0")/.."
export TENSORSOCKET_SANITIZE=1
python3 setup.py -q build_ext --inplace --force
# Python itself is not built with ASan: preload the runtime, and do not report
# the interpreter's deliberate leaks at exit.
libasan=$(${CC:-cc} -print-file-name=libasan.so)
libubsan=$(${CC:-cc} -print-file-name=libubsan.so)
export LD_PRELOAD="$libasan:$libubsan"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
exec python3 -m pytest "$@"
