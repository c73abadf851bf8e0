"""Training data: what users bring (text, token files, instruction JSONL) to batches in a resumable order.

``text``: text corpora and the token cache; ``token_files``: pre-tokenized ``.bin``/``.npy`` files,
memory-mapped; ``chat``: instruction data and chat templates; ``batches``: loaders; ``fingerprints``:
what a checkpoint trained on; ``sources``: ``--data`` to one of them (``open_data``).
"""
from nanotrain.data.batches import BlockLoader, DataPosition
from nanotrain.data.chat import encode_conversation, read_chat_template
from nanotrain.data.fingerprints import DataFingerprint, fingerprint, what_changed
from nanotrain.data.sources import ExampleData, TokenData, TrainingData, open_data
from nanotrain.data.text import load_tokens, read_documents, stdlib_files
from nanotrain.data.token_files import BIN_DTYPES, open_token_file

__all__ = ["BIN_DTYPES", "BlockLoader", "DataFingerprint", "DataPosition", "ExampleData", "TokenData", "TrainingData",
           "encode_conversation", "fingerprint", "load_tokens", "open_data", "open_token_file",
           "read_chat_template", "read_documents", "stdlib_files", "what_changed"]
