"""Datasets: RL prompt sets (verl's parquet schema or JSONL) and their preprocessing.

`tiller.data.rl_dataset`: `RLDataset`, `PromptSampler`, `read_rows`, `write_rows`.
`tiller.data.preprocess`: converters to verl's schema (`gsm8k`); CLI `tiller data gsm8k --out DIR`.
"""
