"""An example black-box agent program for `rollout.agent` (README, "Multi-turn and
tools"): any code that speaks the OpenAI chat API works the same way.

For each episode in $POSTTRAIN_EPISODES (up to 64 at once) it asks the policy the
question, asks once more when the reply holds no number, and posts reward 1 when the
last number of the last reply equals the ground truth (else 0). Each call has a
deadline on the whole request, $AGENT_CALL_TIMEOUT_S seconds (default 300;
posttrain.common.http: httpx's own timeout bounds each read, not the call).

    rollout:
      agent: {command: [python, examples/openai_agent.py], timeout_s: 600}
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from posttrain.common.http import DeadlineClient

CALL_DEADLINE_S = float(os.environ.get("AGENT_CALL_TIMEOUT_S", "300"))


def run_episode(ep: dict) -> None:
    base = ep["base_url"]
    messages = list(ep["messages"])
    http = DeadlineClient(CALL_DEADLINE_S, {"X-Episode-Id": ep["episode_id"]})
    try:
        for _ in range(2):
            body = {"model": "policy", "messages": messages}
            r = http.post(f"{base}/chat/completions", json=body)
            r.raise_for_status()
            reply = r.json()["choices"][0]["message"]
            messages.append({"role": "assistant", "content": reply["content"]})
            numbers = re.findall(r"-?\d+(?:\.\d+)?", reply["content"])
            if numbers:
                break
            messages.append({"role": "user", "content": "Answer with the number only."})
        correct = bool(numbers) and numbers[-1] == str(ep["ground_truth"]).strip()
        http.post(
            f"{base}/episodes/{ep['episode_id']}/reward", json={"reward": float(correct)}
        ).raise_for_status()
    finally:
        http.close()


def main() -> None:
    with open(os.environ["POSTTRAIN_EPISODES"]) as f:
        episodes = [json.loads(line) for line in f if line.strip()]
    # every episode at once: the endpoint samples the calls that arrive together in one
    # engine call, so episodes run one by one (or a few at a time) waste the engine
    with ThreadPoolExecutor(max_workers=max(1, min(64, len(episodes)))) as pool:
        list(pool.map(run_episode, episodes))
    print(f"ran {len(episodes)} episodes")


if __name__ == "__main__":
    main()
