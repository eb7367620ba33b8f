"""Privileged teacher context (`teacher.prompt_template`): the teacher scores, and generates, after
a prompt of its own, filled from the data record's fields (a reference answer, a solution, a hint),
while the student sees only its own prompt.

The template is the user message the teacher is shown: `{prompt}` is the student's prompt text (the
record's `data.field`), any other `{name}` the record's field `name`. It is rendered like the
student's prompt (data.suffix appended, data.chat_template applied, `render_prompt`) with the same
tokenizer (the worker checks the teacher's tokenizer against the student's), and never truncated: a
prefix that does not fit the teacher's context with the response is refused for that task, by
name. The teacher then scores exactly the student's response tokens after this prefix: the
statistics of response token t are the teacher's at context `prefix + response[:t]`.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .data import DataError, read_records, render_prompt

PROMPT_FIELD = "prompt"  # `{prompt}`: the student's prompt text, whatever data.field is called


def template_fields(template: str) -> list[str]:
    """The field names of `template` in order of first use; ValueError for anything but plain
    `{name}` fields (no positional `{}`, attribute or index access, conversion or format spec) and
    for unbalanced braces. `{{` and `}}` are literal braces."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a valid template ({exc}); write a literal brace as {{{{ or }}}}") from None
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"field {{{name}}} is not a plain name: use {{field}} with a record field's name")
        if spec or conversion:
            raise ValueError(f"field {{{name}}} has a conversion or format spec; use plain {{{name}}}")
        if name not in names:
            names.append(name)
    return names


def fill_template(template: str, record: Mapping, prompt_text: str, where: str, key: str = "teacher") -> str:
    """`template` filled from `record` (`{prompt}`: `prompt_text`); DataError naming the field,
    the record (`where`) and the teacher's section (`key`: `teacher`, `teachers[NAME]`) when the
    record lacks a field or holds no text for it."""
    values = {PROMPT_FIELD: prompt_text}
    for name in template_fields(template):
        if name == PROMPT_FIELD:
            continue
        if name not in record:
            keys = sorted(k for k in record if not k.startswith("_"))
            raise DataError(f"{where}: {key}.prompt_template uses {{{name}}} and the record has no field {name!r} "
                            f"(it has {keys})")
        value = record[name]
        if value is None or isinstance(value, (dict, list)):
            raise DataError(f"{where}: {key}.prompt_template uses {{{name}}} and the record's {name!r} is "
                            f"{type(value).__name__}, not text or a number")
        values[name] = str(value)
    return template.format_map(values)


def teacher_prompt_texts(template: str, paths: Sequence[Path], prompts: Sequence[str], *,
                         asks: Callable[[Mapping], bool] | None = None, key: str = "teacher") -> list[str | None]:
    """The teacher's prompt text for every prompt (`prompts`: `data.load_prompts` of the same
    files, whose order this follows): all filled now, so a record lacking a field fails at start.
    `asks(record)`: whether this teacher is asked for the record (`RouteConfig.asks`); a record it
    is not asked for gets None and needs none of the template's fields. `key`: the teacher's
    section, for the message."""
    out: list[str | None] = []
    for path in paths:
        for i, rec in enumerate(read_records(path)):
            if len(out) >= len(prompts):
                raise DataError(f"{path}: more records than prompts read")
            if asks is not None and not asks(rec):
                out.append(None)
                continue
            out.append(fill_template(template, rec, prompts[len(out)], rec.get("_source", f"{path}[{i}]"), key))
    if len(out) != len(prompts):
        raise DataError(f"{len(out)} records for {len(prompts)} prompts")
    return out


class TeacherPrompts:
    """The token ids the teacher sees before a response, per prompt index: the template's prompt
    rendered (cached) when `teacher.prompt_template` is set, else (`TeacherPrompts()`) the student's
    own prompt ids. `asks` and `key`: as `teacher_prompt_texts` (only the prompts routed to this
    teacher are filled)."""

    def __init__(self, tokenizer=None, data_cfg=None, template: str | None = None, prompts: Sequence[str] = (), *,
                 asks: Callable[[Mapping], bool] | None = None, key: str = "teacher"):
        self.tokenizer = tokenizer
        self.data = data_cfg
        self.template = template
        self.key = key
        self.texts = teacher_prompt_texts(template, data_cfg.train_files, prompts, asks=asks, key=key) if template else None
        self._cache: dict[int, list[int]] = {}

    @property
    def privileged(self) -> bool:
        return self.texts is not None

    def ids(self, index: int, student_prompt_ids: Sequence[int]) -> list[int]:
        """The teacher's prefix for prompt `index` (`student_prompt_ids` when there is no template)."""
        if self.texts is None:
            return list(student_prompt_ids)
        ids = self._cache.get(index)
        if ids is None:
            if self.texts[index] is None:
                raise ValueError(f"{self.key}.prompt_template: prompt {index} is not routed to this teacher")
            d = self.data
            ids = self._cache[index] = render_prompt(self.tokenizer, self.texts[index], suffix=d.suffix,
                                                     chat_template=d.chat_template)
        return ids
