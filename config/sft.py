"""`sft:` block of a recipe: supervised fine-tuning on chat data (pydantic only, no torch).

`algorithm: sft` trains the policy on conversations (`messages: [{role, content}, ...]`)
with the cross-entropy of the assistant turns only; system, user and tool turns are
context. It has no rollout side (no engine, reward or push), like DPO.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import Strict
from .facts import AlgorithmFacts, Passes


class SFTConfig(Strict):
    """`algorithm: sft`: next-token cross-entropy on every assistant turn of chat rows
    (the mask read from the chat template: its `{% generation %}` markers when it has
    them, else the tokens each assistant message adds to the rendering), averaged over
    the step's assistant tokens. `train.prompts_per_step` is the conversations per step."""

    max_length: int = Field(
        1024,
        gt=8,
        description="Most tokens of one rendered conversation; longer ones are cut on the "
        "right (their assistant tokens past the cut are not trained on).",
    )
    packing: bool = Field(
        True,
        description="Pack a step's short conversations into rows of up to `max_length` "
        "tokens, each with its own position ids and no attention across conversations "
        "(same loss as unpacked, less padding); false: one conversation per row.",
    )
    eval_examples: int = Field(
        0,
        ge=0,
        description="Conversations held out (the last N after the seeded shuffle) whose "
        "assistant-token loss is measured without training: eval/loss, eval/tokens; "
        "0: no held-out split.",
    )
    eval_every: int = Field(
        10, gt=0, description="Measure the held-out loss every N steps and after the last."
    )

    def facts(self) -> AlgorithmFacts:
        """SFT: chat rows, no reference or critic, one update per step."""
        return AlgorithmFacts(
            data="chat",
            reference=False,
            critic=False,
            updates_per_step=1,
            old_logprob_pass=False,
            passes=Passes(),
        )


#: The generator that makes chat rows (`data.train: {generator: tool_chats, ...}`): the
#: arithmetic problems as tool-use conversations (recipes/data/chats.py).
CHAT_GENERATORS = ("tool_chats",)


def check_sft_data(recipe: Any) -> None:
    """What `algorithm: sft` refuses in a recipe: an `eval:` block (its held-out loss is
    `sft.eval_examples`), reward components, and prompt-only sources.

    Raises:
        ValueError: naming the key and what to set instead.
    """
    from .data import FileData, GeneratorData, sources_of

    if recipe.eval is not None:
        raise ValueError(
            "eval: SFT samples no responses to evaluate; remove the eval block and hold "
            "conversations out with sft.eval_examples: N (their loss is eval/loss)"
        )
    if recipe.rewards:
        raise ValueError(
            "rewards: SFT trains on the conversations' assistant turns and calls no "
            "reward; remove the rewards list"
        )
    for s in sources_of(recipe.data.train):
        if isinstance(s, FileData) or (
            isinstance(s, GeneratorData) and s.generator in CHAT_GENERATORS
        ):
            continue
        made = s.generator if isinstance(s, GeneratorData) else s.reasoning_gym
        raise ValueError(
            f"data.train: SFT trains on conversations, and {made!r} makes prompts only; "
            "give a file of chat rows {path: chats.jsonl} (each row a `messages` list of "
            "{role, content} with at least one assistant turn) or {generator: tool_chats}"
        )


def check_prompt_data(recipe: Any) -> None:
    """An algorithm that samples or trains on pairs gets no chat-only generator, in
    `data.train` nor in `eval.prompts` (held-out prompts are sampled as training's are).

    Raises:
        ValueError: a block names a generator of conversations (`tool_chats`).
    """
    from .data import GeneratorData, MixtureData, sources_of

    blocks = [("data.train", recipe.data.train)]
    if recipe.eval is not None and recipe.eval.prompts is not None:
        blocks.append(("eval.prompts", recipe.eval.prompts))
    for key, block in blocks:
        for i, s in enumerate(sources_of(block)):
            if isinstance(s, GeneratorData) and s.generator in CHAT_GENERATORS:
                where = f"{key}.mixture.{i}" if isinstance(block, MixtureData) else key
                raise ValueError(
                    f"{where}: generator {s.generator!r} makes conversations for "
                    f"algorithm: sft, not prompts for {recipe.algorithm}; use generator: "
                    "arithmetic"
                )
