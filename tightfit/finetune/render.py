"""A record as token ids and a loss mask, tokenized the way TRL's SFTTrainer tokenizes it.

Why TRL's way: a fine-tune moved from TRL to tightfit should see the same tokens and train on the same ones, so
that the losses agree (tests/test_sft_vs_trl.py holds them to 1e-5).
- `text`: the text, with the tokenizer's end-of-sequence token appended unless it ends with it, tokenized with the
  tokenizer's special tokens (a BOS where the tokenizer adds one); every token carries loss.
- `prompt`/`completion` strings: the completion gets the end-of-sequence token as text does; prompt and
  prompt + completion are tokenized apart and the completion starts where the two first differ (a tokenizer may
  merge across the boundary). Lists of messages: the prompt rendered by the chat template with the generation prompt,
  the whole conversation without it, the same rule.
- `messages`: the chat template renders the conversation; the loss is on the assistant's turns. A template with
  `{% generation %}` markers says which tokens those are (transformers' assistant mask, as TRL uses it); one without
  is rendered turn by turn, each assistant turn being what its conversation adds to the one before it followed by
  the generation prompt (so a turn's end-of-turn token is trained on: the model learns to stop), read by
  characters on the rendered text and tokenized once with a fast tokenizer, by tokens otherwise. A template that
  does not render a conversation's turns as prefixes of the whole has to be given markers (`--chat-template`).
`--train-on-prompt` keeps every token's loss. A role the template refuses, or a conversation it renders without the
answer, is a bad record (`BadRecord`).
"""

from __future__ import annotations

from pathlib import Path

from tightfit.errors import UsageError
from tightfit.finetune.records import BadRecord, fields_of


class Renderer:
    """Records of one format into (ids, mask) with one tokenizer (a tightfit ByteTokenizer or HFTokenizer)."""

    def __init__(self, tokenizer, fmt: str, train_on_prompt: bool = False, chat_template: str | None = None) -> None:
        self.fmt, self.train_on_prompt = fmt, train_on_prompt
        self.hf = getattr(tokenizer, "_tok", None)  # the transformers tokenizer, None for bytes
        self.bytes = self.hf is None
        self.eos = None if self.bytes else self.hf.eos_token
        backend = getattr(self.hf, "backend_tokenizer", None) if getattr(self.hf, "is_fast", False) else None
        # Only where transformers' call would add nothing to it: no truncation or padding set in tokenizer.json.
        self.backend = backend if backend is not None and backend.truncation is None and backend.padding is None \
            else None
        self.template = None
        if chat_template is not None:
            path = Path(chat_template)
            try:
                self.template = path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"--chat-template: cannot read {path} ({e}); give a Jinja template file") from None
        chat = fmt == "messages" or fmt == "prompt-completion"
        if chat and not self.bytes:
            self.markers = "{% generation %}" in (self.template or self.hf.chat_template or "")
        else:
            self.markers = False

    def describe(self) -> str:
        if self.fmt == "text":
            return "text records, every token trained on"
        what = "every token trained on (--train-on-prompt)" if self.train_on_prompt else (
            "the loss on the completion" if self.fmt == "prompt-completion" else "the loss on the assistant's turns")
        how = "" if self.fmt == "prompt-completion" else (
            " (the template's generation markers)" if self.markers else " (turn by turn)")
        return f"{self.fmt} records, {what}{how}"

    def __call__(self, record: object, where: str) -> tuple[list[int], list[int]]:
        """(ids, mask): mask[i] is 1 where token i carries loss."""
        out = self.many([(where, record)])[0]
        if isinstance(out, BadRecord):
            raise out
        return out

    def many(self, items: list[tuple[str, object]]) -> list[tuple[list[int], list[int]] | BadRecord]:
        """Each (where, record) rendered, or the BadRecord it is. Strings are encoded in one call of the tokenizer
        for all of them (a fast tokenizer encodes a batch on all cores); conversations one at a time."""
        out: list = [None] * len(items)
        texts: list[tuple[int, tuple]] = []  # (item, fields) of the records whose text is one batched call
        for k, (where, record) in enumerate(items):
            try:
                if isinstance(record, BadRecord):
                    raise record
                values = fields_of(record, self.fmt, where)
                if self.fmt == "messages":
                    out[k] = self._conversation(values[0], where)
                elif self.fmt == "prompt-completion" and not isinstance(values[0], str):
                    out[k] = self._chat_prompt_completion(*values, where=where)
                else:
                    texts.append((k, values))
            except BadRecord as e:
                out[k] = e
        if texts:
            if self.fmt == "text":
                encoded = self._encode_many([self._with_eos(v[0]) for _, v in texts])
                for (k, _), ids in zip(texts, encoded):
                    out[k] = (ids, [1] * len(ids))
            else:
                prompts = self._encode_many([v[0] for _, v in texts])
                whole = self._encode_many([v[0] + self._with_eos(v[1]) for _, v in texts])
                for (k, _), prompt_ids, ids in zip(texts, prompts, whole):
                    start = _common_prefix(prompt_ids, ids)
                    out[k] = (ids, [0] * start + [1] * (len(ids) - start))
        for k, (where, _) in enumerate(items):
            if isinstance(out[k], BadRecord):
                continue
            ids, mask = out[k]
            if self.train_on_prompt:
                mask = [1] * len(ids)
            if not any(mask[1:]):
                out[k] = BadRecord(where, "has no answer token to train on after tokenizing", "--data")
            else:
                out[k] = (list(ids), list(mask))
        return out

    def _with_eos(self, text: str) -> str:
        return text if self.eos is None or text.endswith(self.eos) else text + self.eos

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, with the tokenizer's special tokens (as `tokenizer(text)` gives them)."""
        if self.bytes:
            return [list(t.encode("utf-8")) for t in texts]
        if self.backend is not None:  # the Rust tokenizer itself: what `self.hf(text=texts)` calls, without the
            # conversion of each encoding into Python dicts (15% of the time)
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=True)]
        return self.hf(text=texts)["input_ids"]

    def _chat_prompt_completion(self, prompt: list, completion: list, where: str) -> tuple[list[int], list[int]]:
        prompt_ids = self._chat(prompt, where, add_generation_prompt=True)["input_ids"]
        ids = self._chat(prompt + completion, where)["input_ids"]
        start = _common_prefix(prompt_ids, ids)
        return ids, [0] * start + [1] * (len(ids) - start)

    def _conversation(self, messages: list, where: str) -> tuple[list[int], list[int]]:
        if self.markers:
            out = self._chat(messages, where, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), list(out["assistant_masks"])
        if self.backend is not None:
            return self._conversation_by_text(messages, where)
        ids = self._chat(messages, where)["input_ids"]
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._chat(messages[:i], where, add_generation_prompt=True)["input_ids"] if i else []
            through = self._chat(messages[:i + 1], where)["input_ids"]
            if through != ids[:len(through)]:
                raise UsageError(f"--chat-template: the template renders the conversation of {where} up to turn {i} "
                                 "as other tokens than the start of the whole; give a template with "
                                 "{% generation %} markers around the assistant's turns (--chat-template FILE)")
            for j in range(_common_prefix(before, through), len(through)):
                mask[j] = 1
        return ids, mask

    def _conversation_by_text(self, messages: list, where: str) -> tuple[list[int], list[int]]:
        """Turn by turn on the rendered text, tokenized once: each assistant turn is the characters its
        conversation adds to the one before it with the generation prompt, and a token carries loss where its
        characters reach into one (as transformers reads generation markers: by characters)."""
        text = self._render(messages, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], where, add_generation_prompt=True) if i else ""
            through = self._render(messages[:i + 1], where)
            if not (text.startswith(through) and through.startswith(before)):
                raise UsageError(f"--chat-template: the template renders the conversation of {where} up to turn {i} "
                                 "as other text than the start of the whole; give a template with "
                                 "{% generation %} markers around the assistant's turns (--chat-template FILE)")
            spans.append((len(before), len(through)))
        enc = self.backend.encode(text, add_special_tokens=False)  # as apply_chat_template tokenizes
        mask = [int(any(end > a and start < b for a, b in spans)) for start, end in enc.offsets]
        return list(enc.ids), mask

    def _render(self, messages: list, where: str, **kwargs) -> str:
        return self._chat(messages, where, tokenize=False, **kwargs)

    def _chat(self, messages: list, where: str, **kwargs) -> dict:
        if self.bytes:
            raise UsageError("--data: chat records need a tokenizer with a chat template; give --tokenizer (a Hugging "
                             "Face tokenizer folder), or --model hf:DIR whose folder has one")
        if self.template is None and not self.hf.chat_template:
            raise UsageError("--chat-template: the tokenizer has no chat template to render the messages with; "
                             "give one as a Jinja file")
        try:
            if kwargs.get("tokenize") is False:
                return self.hf.apply_chat_template(messages, chat_template=self.template, **kwargs)
            return self.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                               chat_template=self.template, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or a template's raise_exception
            first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise BadRecord(where, f"the chat template refuses it ({first})", "--data") from None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
