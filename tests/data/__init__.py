"""Data files the tests read; README.md says where each comes from."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
MOONCAKE_SAMPLE = str(HERE / "mooncake_conversation_sample.jsonl")  # 358 requests of the Mooncake conversation trace
