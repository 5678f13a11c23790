"""The data wing: a recipe's data blocks to the items a run trains on.

load.py (`load_data`) → sources.py (`items_of`: mixtures, files, generators) → the
kind's row reader (layouts.py prompts, pairs.py preference pairs, chats.py
conversations) over rows.py, every chat message checked once (items.py); generators.py
holds the registry of data made in code; stream.py the prompts a run draws; coverage.py
the reward checks; pair_tokens.py and chats.py the token ids. Imports only config/,
common/ and itself.
"""

from .load import LoadedData, load_data, load_eval_prompts, load_heldout_pairs, load_prompts
from .stream import PromptStream, prompt_stream

__all__ = [
    "LoadedData",
    "PromptStream",
    "load_data",
    "load_eval_prompts",
    "load_heldout_pairs",
    "load_prompts",
    "prompt_stream",
]
