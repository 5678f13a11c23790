"""An RL loop written against the official `tinker` SDK, run on `posttrain serve`: the
quickstart's task (one-digit addition, recipes/quickstart_grpo.yaml's data, system
prompt, stop strings and `math` reward) with group sampling, group-mean advantages and
the `importance_sampling` loss; held-out pass@1 before and after.

    posttrain serve &            # prints TINKER_BASE_URL and TINKER_API_KEY to export
    python examples/tinker_rl_loop.py --steps 20

Prints one line per step and a JSON summary (pass@1 before/after, seconds per
forward_backward + optim_step round trip).
"""

from __future__ import annotations

import argparse
import json
import time

import tinker
from tinker import types

from posttrain.config.data import GeneratorData
from posttrain.recipes.data.generators import arithmetic
from posttrain.rewards.math_verifier import score_math

SYSTEM = "Reply with only the final number."


def problems(size: int, seed: int) -> list[tuple[str, str]]:
    cfg = GeneratorData(
        generator="arithmetic", size=size, seed=seed, min_digits=1, max_digits=1, operators=["+"]
    )
    return [(p.question, p.ground_truth) for p in arithmetic(cfg)]


def encode(tok, question: str) -> list[int]:  # noqa: ANN001 (a transformers tokenizer)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def reward(tok, tokens: list[int], gold: str) -> float:  # noqa: ANN001
    return score_math(tok.decode(tokens, skip_special_tokens=True), gold)[0]


def pass_at_1(sampler, tok, items, params, k: int) -> float:  # noqa: ANN001
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(encode(tok, q)), num_samples=k, sampling_params=params
        )
        for q, _ in items
    ]
    scores = [
        reward(tok, s.tokens, gold)
        for f, (_, gold) in zip(futures, items, strict=True)
        for s in f.result().sequences
    ]
    return sum(scores) / len(scores)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    args = ap.parse_args()

    service = tinker.ServiceClient()  # TINKER_BASE_URL / TINKER_API_KEY
    tc = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result()
    tok = tc.get_tokenizer()
    params = types.SamplingParams(max_tokens=32, temperature=1.0, stop=["\n", "."])
    train, held = problems(500, 0), problems(16, 1000)
    before = pass_at_1(tc.save_weights_and_get_sampling_client(), tok, held, params, 4)
    print(f"pass@1 before: {before:.3f}", flush=True)
    round_trips = []
    for step in range(args.steps):
        sampler = tc.save_weights_and_get_sampling_client()
        batch = train[step * args.prompts : (step + 1) * args.prompts]
        futures = [
            (
                encode(tok, q),
                gold,
                sampler.sample(
                    types.ModelInput.from_ints(encode(tok, q)),
                    num_samples=args.group,
                    sampling_params=params,
                ),
            )
            for q, gold in batch
        ]
        data, rewards = [], []
        for prompt, gold, fut in futures:
            seqs = fut.result().sequences
            rs = [reward(tok, s.tokens, gold) for s in seqs]
            rewards += rs
            mean = sum(rs) / len(rs)
            for s, r in zip(seqs, rs, strict=True):
                if r == mean:  # no signal in this sample (its whole group agrees)
                    continue
                ids = prompt + list(s.tokens)
                pad = [0.0] * (len(prompt) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={
                            "target_tokens": ids[1:],
                            "logprobs": pad + list(s.logprobs),
                            "advantages": pad + [r - mean] * len(s.tokens),
                        },
                    )
                )
        t0 = time.perf_counter()
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            op = tc.optim_step(types.AdamParams(learning_rate=args.lr))
            fb.result()
            op.result()
            round_trips.append(time.perf_counter() - t0)
        print(
            f"step {step}: reward {sum(rewards) / len(rewards):.3f} datums {len(data)} "
            f"round trip {time.perf_counter() - t0:.2f}s",
            flush=True,
        )
    after = pass_at_1(tc.save_weights_and_get_sampling_client(), tok, held, params, 4)
    print(
        json.dumps(
            {
                "pass@1_before": before,
                "pass@1_after": after,
                "steps": args.steps,
                "round_trip_s_mean": sum(round_trips) / max(1, len(round_trips)),
            }
        )
    )
    service.close("success").result()  # finish the session: the service frees it


if __name__ == "__main__":
    main()
