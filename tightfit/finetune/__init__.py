"""Fine-tuning data and adapters for `tightfit train`: records (JSONL, Parquet, a `datasets` folder), rendered with
the tokenizer's chat template, masked to the answer, packed into the sequence length and cached as memory-mapped
token files; and LoRA from the command line (peft).

Why a package of its own: the text corpus (tightfit/train/data.py) is one token stream cut into windows; fine-tuning
data is a list of examples, each with the tokens that carry loss marked. Both feed the same loop through one call,
`step_batches`, and the same loss (tightfit/train/batch.py). Files:
- records.py: where records come from and what format they are in; a bad record is one line naming file and record.
- render.py: a record as token ids and a loss mask, the way TRL's SFTTrainer tokenizes it.
- token_cache.py: the tokenized examples on disk, memory-mapped, keyed by the data files and the tokenizer.
- packing.py: whole examples into rows of --seq-len (best-fit decreasing).
- packed_attention.py: whether the model keeps attention inside each packed example (checked on a tiny twin).
- examples.py: the dataset the loop draws its batches from.
- lora.py: `--lora r=..,alpha=..`: peft adapters on the model, saved in peft's layout, merged on request.
"""
