#!/usr/bin/env bash
# The verl_env tests under torch 2.11.0, the torch verl 0.9.1's engine extras (fsdp, vllm,
# sglang, cpu) pin, in an environment of its own (.venv-verl-torch211), set up from scratch.
#
# Not part of tests/run.sh and not run in CI: torch 2.11.0 from the default index is the CUDA
# build and pulls its CUDA libraries, several GB of wheels. Run it by hand before a release, or
# when verl or torch moves:
#
#   bash tests/run-verl-torch211.sh [pytest arguments...]
#
# Pins: tests/environments/verl-torch211-pins.txt (verl 0.9.1, tensordict 0.10.0, torch 2.11.0).
# The tests run with ROLLOUT_LEDGER_REQUIRE_VERL=1, so a missing verl fails them instead of
# skipping them; PostgreSQL at 127.0.0.1:5432 is used when it answers, as in tests/run.sh.
# pytest's exit status is the script's.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-verl-torch211
pins=tests/environments/verl-torch211-pins.txt

python3 -m venv "$venv"
"$venv/bin/pip" install -q -c "$pins" torch==2.11.0
"$venv/bin/pip" install -q -c "$pins" -e '.[test,verl,transferqueue,export,trackers,report]'
"$venv/bin/pip" check
"$venv/bin/python" -c 'import torch, verl, tensordict; print("torch", torch.__version__, "verl", verl.__version__, "tensordict", tensordict.__version__)'

ROLLOUT_LEDGER_REQUIRE_VERL=1 exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -m verl_env "$@"
