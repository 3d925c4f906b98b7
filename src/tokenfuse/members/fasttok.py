"""A light tokenizer for members that do not need transformers (llama.cpp members).

Loading a 262k-entry tokenizer through ``AutoTokenizer`` parses tokenizer.json in Python twice
(seconds); this reads it with the Rust ``tokenizers`` library and takes the few settings tokenfuse
uses (special tokens, chat template) from tokenizer_config.json. It offers the subset of the
Hugging Face tokenizer interface that tokenfuse calls: ``backend_tokenizer``, ``__call__``,
``apply_chat_template`` (rendered with a sandboxed Jinja2 environment like transformers does),
``eos_token_id``, ``bos_token_id``, ``all_special_ids``, ``convert_ids_to_tokens``, ``decode``,
``__len__``.

For a bundled model the directory is written by ``tokenfuse.members.gguf_tokenizer`` straight from
the GGUF (the same bytes as the transformers conversion, which ``tests/test_gguf_tokenizer.py``
checks).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any


def _content(tok: Any) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class FastTokenizer:
    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        d = Path(directory)
        self.backend_tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        jinja = d / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        self.chat_template = template
        self.bos_token = _content(cfg.get("bos_token"))
        self.eos_token = _content(cfg.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        added = self.backend_tokenizer.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, a in added.items() if a.special)
        self.all_special_tokens = [added[i].content for i in self.all_special_ids]

    def _id(self, token: str | None) -> int | None:
        return self.backend_tokenizer.token_to_id(token) if token else None

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = False, tokenize: bool = False,
                            **kwargs) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = _environment().from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", **kwargs)
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
