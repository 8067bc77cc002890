"""A black-box agent for the gateway's tests: the plain `openai` client, configured only by
OPENAI_BASE_URL and OPENAI_API_KEY, as any agent would be.

`python agent_script.py CALLS THEN`: make CALLS chat calls (a growing conversation), then
`exit:N` (exit with status N), `hang` (block forever) or `kill` (SIGKILL itself).
"""

import os
import signal
import sys

import openai


def main() -> None:
    calls, then = int(sys.argv[1]), sys.argv[2]
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "user", "content": "start"}]
    for n in range(calls):
        reply = client.chat.completions.create(model="m", messages=messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"tool result {n}"},
        ]
    print(f"made {calls} calls", file=sys.stderr)
    if then == "hang":
        while True:
            signal.pause()  # blocked until a signal ends it, as a hung agent is
    if then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(then.removeprefix("exit:")))


if __name__ == "__main__":
    main()
