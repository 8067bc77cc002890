#!/usr/bin/env bash
# The whole test suite, in the two environments the project's users run, each set up from scratch:
#
#   .venv       the newest releases (tensordict, numpy, ...) with the TransferQueue, TRL, bench,
#               export, trackers and report extras: every test, its files shared out between two
#               pytest-xdist workers (`--dist loadfile`: a file's module-scoped databases stay in one
#               worker; every database a test makes has a name of its own, so workers never collide).
#   .venv-verl  verl 0.9.1 and its pins (tensordict 0.10.0, see tests/environments/verl-pins.txt),
#               with TransferQueue as verl's V1 trainer has it, and the data-out extras (so every
#               test module collects there, none skipped at collection): the tests marked `verl_env`
#               (batches, the verl integration and metrics, the synchronous ledger, the example),
#               with ROLLOUT_LEDGER_REQUIRE_VERL=1 so a missing verl fails them instead of
#               skipping them.
#   .venv-phoenix Arize Phoenix and playwright (tests/otel/phoenix-requirements.txt), kept out of the
#               project's environment, and Debian's chromium: the tests marked `phoenix` export
#               into a real Phoenix and open its page in headless Chromium; they run after the main
#               suite (which deselects them), with ROLLOUT_LEDGER_REQUIRE_PHOENIX=1 so a missing
#               Phoenix or Chromium fails them instead of skipping them. Screenshots: test-artifacts/.
#
# The runs go side by side (the verl and Phoenix environments install while the main suite runs);
# the exit status is the main run's if it failed, else the verl run's, else the Phoenix run's. pytest's own codes pass
# through unchanged: 5 ("no tests collected") is a failure here too.
set -uo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 \
  && .venv/bin/pip install -q -e '.[test,transferqueue,bench,export,trackers,report,trl,otel,gateway]' || exit 1

verl_log="$(mktemp -t rollout-ledger-verl-XXXXXX.log)"
(
  python3 -m venv .venv-verl \
    && .venv-verl/bin/pip install -q -c tests/environments/verl-pins.txt torch==2.13.0 \
    && .venv-verl/bin/pip install -q -c tests/environments/verl-pins.txt -e '.[test,verl,transferqueue,export,trackers,report]' \
    && .venv-verl/bin/pip check \
    && ROLLOUT_LEDGER_REQUIRE_VERL=1 .venv-verl/bin/python -m pytest -q -p no:cacheprovider -m verl_env
) >"$verl_log" 2>&1 &
verl_pid=$!

phoenix_log="$(mktemp -t rollout-ledger-phoenix-XXXXXX.log)"
(
  { command -v chromium >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }; } \
    && python3 -m venv .venv-phoenix \
    && .venv-phoenix/bin/pip install -q -r tests/otel/phoenix-requirements.txt
) >"$phoenix_log" 2>&1 &
phoenix_pid=$!

echo "== ruff: format and lint (settings in pyproject.toml)"
lint_status=0
.venv/bin/ruff format --check --quiet . && .venv/bin/ruff check --quiet . || lint_status=1

echo "== newest releases (.venv): the whole suite (its 25 slowest tests listed at the end, to keep CI in budget)"
ROLLOUT_LEDGER_REQUIRE_TRL=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 -m "not phoenix"
main_status=$?

echo "== Arize Phoenix (.venv-phoenix): the phoenix tests"
wait "$phoenix_pid"
phoenix_build=$?
cat "$phoenix_log"
rm -f "$phoenix_log"
phoenix_status=$phoenix_build
if [ "$phoenix_build" -eq 0 ]; then
  ROLLOUT_LEDGER_REQUIRE_PHOENIX=1 .venv/bin/python -m pytest -q -p no:cacheprovider -m phoenix tests/otel
  phoenix_status=$?
fi

wait "$verl_pid"
verl_status=$?
echo "== verl 0.9.1 pins (.venv-verl): the verl_env tests"
cat "$verl_log"
rm -f "$verl_log"
echo "== exit: ruff $lint_status, newest releases $main_status, verl pins $verl_status, phoenix $phoenix_status"
[ "$main_status" -ne 0 ] && exit "$main_status"
[ "$lint_status" -ne 0 ] && exit "$lint_status"
[ "$verl_status" -ne 0 ] && exit "$verl_status"
exit "$phoenix_status"
