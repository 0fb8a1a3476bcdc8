"""RL prompt sets: verl's parquet schema (or JSONL), tokenized once, and a seeded, resumable sampler.

A row of an RL prompt file (verl's `RLHFDataset` schema):

    data_source:  str                    routes the sample to its reward scorer (`data.reward_fn_key`)
    prompt:       list of chat messages  [{"role": "user", "content": "..."}]  (`data.prompt_key`),
                  or a plain string (rendered as one user message when a chat template is used)
    ability:      str                    (kept, unused)
    reward_model: {"style": "rule", "ground_truth": ...}
    extra_info:   dict                   (passed to the reward function)

JSONL rows may also give `ground_truth` at the top level. Prompts are rendered with the tokenizer's
chat template (`add_generation_prompt=True`, plus `data.apply_chat_template_kwargs` as template variables; the
template is `actor_rollout_ref.model.custom_chat_template` when set) and tokenized without extra special tokens. A prompt longer
than `data.max_prompt_length` is dropped (`filter_overlong_prompts`) or handled by `data.truncation`:
`error` (a `DataError` naming the file and row), `left` (keep the end), `right` (keep the start) or
`middle` (keep both ends). With multi-turn tools (`tool_schemas`: multi_turn.tool_config_path /
function_tool_path) the prompt is rendered with the tools' schemas first, so the filter sees what the rollout sends.

`PromptSampler` yields the prompt indices of each step: a permutation per epoch drawn from
`numpy.random.default_rng(seed + epoch)` (no shuffle: in file order), whole batches only (drop last, as
verl). Its position (`epoch`, `index`) is part of every checkpoint, so a resumed run sees the same prompts.

Images (vision-language models, verl's multimodal schema): a row's `images` column (`data.image_key`) holds a
list of `{"bytes": ...}` / `{"path": ...}` entries (a single entry, raw bytes, a path or a PIL image also do:
TRL's and OpenRLHF's layouts), and each `<image>` in the prompt messages' text marks where one goes (content
already in parts, `{"type": "image"}`, is taken as is). Such a row is rendered by the processor's chat template and
encoded by `tiller.models.vision.encode_image_prompt`: `prompt_ids` then hold one `<|image_pad|>` per merged
patch, and `multi_modal_inputs` the `pixel_values` / `image_grid_thw` the model takes. An unreadable image, a
missing file or a placeholder count that differs from the image count is a `DataError` naming the file and row.
An image prompt is never truncated (cutting image tokens breaks the model's input): over the limit it is
filtered (`filter_overlong_prompts`) or an error.

Deviations from verl: prompts are not padded here (the rollout pads); no videos.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tiller.data.files import parquet_problem, PARQUET_MAGIC, read_parquet, read_rows, write_rows  # noqa: F401 (their old home)
from tiller.data.sources import apply_template, load_sources
from tiller.errors import ConfigError, DataError
from tiller.models.loading import VISION_FAMILIES
from tiller.models.vision import encode_image_prompt, split_placeholders, to_pil


@dataclass
class PromptItem:
    """One tokenized prompt."""

    prompt_ids: list[int]
    prompt_text: str
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    raw_prompt: Any = None
    uid: str = ""
    where: str = ""  # "<file> row <i>", for errors about this row
    ground_truth_key: str = ""  # the field the ground truth came from (reward_model.ground_truth, ground_truth, ...)
    images: list | None = None
    """PIL images of an image prompt (None for text)."""
    multi_modal_inputs: dict | None = None
    """`pixel_values [N_patches, D]` and `image_grid_thw [n_images, 3]` of an image prompt (None for text)."""
    agent_name: str | None = None
    """verl's per-row agent loop (`agent_name` column): tool_agent or single_turn_agent (None: the run's default)."""
    route: str | None = None
    """The row's value of the dataset's `route_key` column (several distillation teachers: which one scores it)."""


HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def with_tools_system_message(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """`messages` with the tool schemas described in the system message (Qwen2.5's wording), for chat templates
    that do not take `tools=` themselves."""
    system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in schemas))
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{system}"
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def render_prompt_with_schemas(tokenizer, messages: list[dict], schemas: Sequence[dict],
                               chat_template_kwargs: dict | None = None) -> str:
    """The prompt text with the tools' OpenAI `schemas`, generation prompt on: passed as `tools=` when the chat
    template uses them (Qwen2.5, Hermes, Llama 3.1), else as a system message (`with_tools_system_message`).
    `chat_template_kwargs`: extra template variables (data.apply_chat_template_kwargs)."""
    schemas = list(schemas)
    if schemas and "tools" not in (getattr(tokenizer, "chat_template", None) or ""):
        messages, schemas = with_tools_system_message(messages, schemas), []
    return tokenizer.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))


def render_prompt(raw: Any, tokenizer, apply_chat_template: bool, where: str, input_template: str | None = None,
                  chat_template_kwargs: dict | None = None, tool_schemas: Sequence[dict] | None = None) -> str:
    """Prompt text as the policy sees it: chat messages through the template, strings as one user turn.
    Without a chat template, a string prompt goes through `input_template` (OpenRLHF's "User: {}\\nAssistant: ").
    `chat_template_kwargs`: extra template variables (verl's data.apply_chat_template_kwargs); `tool_schemas`: the
    multi-turn loop's tools, rendered into the prompt (`render_prompt_with_schemas`)."""
    if isinstance(raw, np.ndarray):
        raw = raw.tolist()
    if isinstance(raw, str):
        messages = [{"role": "user", "content": raw}]
    elif isinstance(raw, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in raw) and raw:
        messages = [dict(m) for m in raw]
    else:
        raise DataError(f"{where}: prompt must be a string or a non-empty list of chat messages "
                        f"({{'role': ..., 'content': ...}}), got {type(raw).__name__}")
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        return render_prompt_with_schemas(tokenizer, messages, tool_schemas or (), chat_template_kwargs)
    if isinstance(raw, str):
        if input_template:
            return apply_template(input_template, raw)
        return raw
    return "\n".join(str(m["content"]) for m in messages)


def _fit_length(ids: list[int], max_len: int, truncation: str, where: str) -> list[int]:
    if len(ids) <= max_len:
        return ids
    if truncation == "left":
        return ids[-max_len:]
    if truncation == "right":
        return ids[:max_len]
    if truncation == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    raise DataError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={max_len}; "
                    "set data.truncation=left|right|middle or data.filter_overlong_prompts=True")


AGENT_NAMES = ("tool_agent", "single_turn_agent")


def _agent_name(row: dict, where: str, multi_turn: bool, custom: Sequence[str] = ()) -> str | None:
    """verl's `agent_name` column: which agent loop runs the row (tool_agent: the multi-turn tool loop,
    single_turn_agent: one turn without tools, or a custom loop of agent_loop_config_path); None when the row has
    none."""
    name = row.get("agent_name")
    if name is None:
        return None
    if name in custom:
        return name
    if name not in AGENT_NAMES:
        known = ", ".join(list(AGENT_NAMES) + sorted(custom))
        raise DataError(f"{where}: agent_name={name!r}: not one of the run's agent loops ({known}; custom loops "
                        "come from actor_rollout_ref.rollout.agent.agent_loop_config_path)")
    if name == "tool_agent" and not multi_turn:
        raise DataError(f"{where}: agent_name='tool_agent' needs the multi-turn tool loop: set "
                        "actor_rollout_ref.rollout.multi_turn.enable=true (and its tools)")
    return name


def _check_tools_kwargs(extra_info: Any, tool_schemas: Sequence[dict], where: str) -> None:
    """A multi-turn row's `extra_info.tools_kwargs` (verl's per-sample tool arguments, {tool name: {"create_kwargs":
    {...}}}): a mapping naming loaded tools, present when the row sets `need_tools_kwargs` (verl warns; here a row
    whose tools would be created without their arguments is an error)."""
    info = extra_info if isinstance(extra_info, dict) else {}
    kwargs = info.get("tools_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise DataError(f"{where}: extra_info.tools_kwargs must be a mapping {{tool name: {{'create_kwargs': "
                        f"{{...}}}}}}, got {type(kwargs).__name__}")
    given = {name: value for name, value in (kwargs or {}).items() if value is not None}  # (parquet structs: None)
    if info.get("need_tools_kwargs") and not given:
        raise DataError(f"{where}: extra_info.need_tools_kwargs is true but extra_info.tools_kwargs is empty")
    names = {s.get("function", {}).get("name") for s in tool_schemas}
    for name, value in given.items():
        if name not in names:
            raise DataError(f"{where}: extra_info.tools_kwargs names tool {name!r}, which is not among the loaded "
                            f"tools ({', '.join(sorted(map(str, names)))}: multi_turn.tool_config_path / "
                            "function_tool_path)")
        if not isinstance(value, dict) or not isinstance(value.get("create_kwargs") or {}, dict):
            raise DataError(f"{where}: extra_info.tools_kwargs.{name} must be a mapping with a 'create_kwargs' "
                            f"mapping, got {value!r:.200}")


class RLDataset:
    """Tokenized prompts from one or more files (see the module docstring for the schema).

    `self.num_filtered` counts prompts dropped by `filter_overlong_prompts`.
    """

    def __init__(self, files: Sequence[str] | str, tokenizer, *, prompt_key: str = "prompt",
                 reward_fn_key: str = "data_source", max_prompt_length: int = 256, truncation: str = "error",
                 filter_overlong_prompts: bool = False, apply_chat_template: bool = True,
                 require_ground_truth: bool = False,
                 return_raw_chat: bool = False, max_samples: int = -1, what: str = "data.train_files",
                 label_key: str | None = None, default_data_source: str | None = None,
                 input_template: str | None = None, probs: Sequence[float] | None = None, split: str = "train",
                 seed: int = 42, processor=None, image_key: str = "images",
                 chat_template_kwargs: dict | None = None, tool_schemas: Sequence[dict] | None = None,
                 agent_names: Sequence[str] = (), route_key: str | None = None):
        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files:
            raise ConfigError(f"{what} is empty: give at least one .parquet or .jsonl file")
        self.items: list[PromptItem] = []
        self.num_filtered = 0
        rows = load_sources([str(f) for f in files], split, probs, seed, max_per_source=max_samples)
        if not rows:
            raise DataError(f"{', '.join(map(str, files))}: no rows")
        for k, (where, row) in enumerate(rows):
            if prompt_key not in row:
                raise DataError(f"{where}: missing column {prompt_key!r} (columns: {', '.join(row)}); "
                                "set data.prompt_key")
            if row[prompt_key] is None:
                raise DataError(f"{where}: empty {prompt_key!r}")
            if reward_fn_key in row:
                source = str(row[reward_fn_key])
            elif default_data_source is not None:
                source = default_data_source
            else:
                raise DataError(f"{where}: missing column {reward_fn_key!r} (columns: {', '.join(row)}); set "
                                "data.reward_fn_key, or data.default_data_source for rows without one")
            route = None
            if route_key is not None:
                if route_key == reward_fn_key:
                    route = source  # (data.default_data_source included)
                elif row.get(route_key) is None:
                    raise DataError(f"{where}: no {route_key!r} column, which algorithm.distill.teacher_key routes "
                                    f"each sample's teacher by (columns: {', '.join(row)})")
                else:
                    route = str(_plain(row[route_key]))
            if label_key is not None and label_key not in row:
                raise DataError(f"{where}: missing column {label_key!r} (data.label_key); row has {sorted(row)}")
            if row.get("videos") is not None and len(row["videos"]):
                raise DataError(f"{where}: the row has videos; tiller's vision-language path takes images only "
                                "(sample frames into the images column)")
            agent_name = _agent_name(row, where, tool_schemas is not None, agent_names)
            row_schemas = None if agent_name == "single_turn_agent" else tool_schemas  # (verl: no tools rendered)
            if tool_schemas is not None and agent_name != "single_turn_agent":
                _check_tools_kwargs(row.get("extra_info"), tool_schemas, where)
            images = row_images(row, image_key, where)
            vision = None
            if images:
                if processor is None:
                    raise DataError(f"{where}: the row has images (column {image_key!r}) but the model is not a "
                                    f"vision-language model tiller trains ({VISION_FAMILIES}); drop the column or "
                                    "change data.image_key")
                vision = encode_image_row(row[prompt_key], images, processor, where, chat_template_kwargs,
                                          row_schemas)
                text, ids = vision.text, vision.prompt_ids
            else:
                text = render_prompt(row[prompt_key], tokenizer, apply_chat_template, where, input_template,
                                     chat_template_kwargs, row_schemas)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise DataError(f"{where}: prompt tokenizes to 0 tokens")
            if len(ids) > max_prompt_length and filter_overlong_prompts:
                self.num_filtered += 1
                continue
            if vision is not None and len(ids) > max_prompt_length:
                raise DataError(f"{where}: image prompt has {len(ids)} tokens > data.max_prompt_length="
                                f"{max_prompt_length} (image prompts are not truncated); raise it or set "
                                "data.filter_overlong_prompts=True")
            ids = _fit_length(ids, max_prompt_length, truncation, where)
            stem, index = Path(where.rsplit(" row ", 1)[0]).stem, where.rsplit(" row ", 1)[1]
            ground_truth = _plain(row[label_key]) if label_key is not None else _ground_truth(row)
            self.items.append(PromptItem(
                prompt_ids=list(ids), prompt_text=text, data_source=source,
                ground_truth=ground_truth, extra_info=dict(row.get("extra_info") or {}),
                raw_prompt=row[prompt_key] if return_raw_chat else None,
                uid=f"{stem}-{index}" if probs is None else f"{stem}-{index}-{k}",
                where=where, ground_truth_key=label_key or _ground_truth_key(row),
                images=images or None,
                multi_modal_inputs=None if vision is None else {"pixel_values": vision.pixel_values,
                                                                "image_grid_thw": vision.image_grid_thw},
                agent_name=agent_name, route=route,
            ))
            if require_ground_truth and self.items[-1].ground_truth is None:
                raise DataError(f"{where}: no ground truth (reward_model.ground_truth, or a top-level "
                                f"ground_truth) and the rule scorer for data_source "
                                f"{self.items[-1].data_source!r} needs one; fix the row, or score with "
                                "custom_reward_function.path / reward_model.enable=true")
            if 0 < max_samples <= len(self.items):
                break
        self.num_rows = len(self.items) + self.num_filtered
        if not self.items:
            why = (f" (all {self.num_filtered} prompts are longer than data.max_prompt_length="
                   f"{max_prompt_length} and data.filter_overlong_prompts=True)") if self.num_filtered else ""
            raise DataError(f"{what}: no prompts left{why}")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def row_images(row: dict, image_key: str, where: str) -> list:
    """The row's images as PIL images ([] when the column is absent or empty)."""
    value = row.get(image_key)
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        value = [value]
    return [to_pil(img, f"{where} {image_key}[{j}]") for j, img in enumerate(value)]


def encode_image_row(raw: Any, images: list, processor, where: str, chat_template_kwargs: dict | None = None,
                     tool_schemas: Sequence[dict] | None = None):
    """One image prompt through the processor's chat template and image processor; `tool_schemas` (the multi-turn
    loop's tools) rendered as for text prompts (`render_prompt_with_schemas`)."""
    if isinstance(raw, np.ndarray):
        raw = raw.tolist()
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise DataError(f"{where}: prompt must be a string or a list of chat messages, got {type(raw).__name__}")
    messages = [dict(m) for m in messages]
    schemas = list(tool_schemas or ())
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None) or ""
    if schemas and "tools" not in template:
        messages, schemas = with_tools_system_message(messages, schemas), []
    messages = split_placeholders(messages, len(images), where)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **({"tools": schemas} if schemas else {}), **(chat_template_kwargs or {}))
    return encode_image_prompt(processor, text, images, where)


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _ground_truth_key(row: dict) -> str:
    rm = row.get("reward_model")
    return "reward_model.ground_truth" if isinstance(rm, dict) and "ground_truth" in rm else "ground_truth"


def _ground_truth(row: dict) -> Any:
    rm = row.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        gt = rm["ground_truth"]
    else:
        gt = row.get("ground_truth")
    return _plain(gt)


def build_rl_dataset(data_cfg, tokenizer, files: Sequence[str], *, max_samples: int = -1,
                     what: str = "data.train_files", require_ground_truth: bool = False, processor=None,
                     tool_schemas: Sequence[dict] | None = None, agent_names: Sequence[str] = (),
                     route_key: str | None = None) -> RLDataset:
    """`RLDataset` from a `tiller.config.schema.DataConfig`; says how many prompts filter_overlong_prompts dropped.
    `require_ground_truth`: a row without one is an error naming the file and row (rule scoring needs it).
    `processor`: a vision-language model's processor (`tiller.models.vision.load_processor`): rows with images.
    `tool_schemas`: the multi-turn loop's tools (tool_config_path, function_tool_path): every text prompt is rendered
    with them, so the length filter and truncation see the prompt the rollout sends (as verl's dataset).
    `route_key`: the column each item's `route` is read from (several distillation teachers)."""
    ds = RLDataset(files, tokenizer, prompt_key=data_cfg.prompt_key, reward_fn_key=data_cfg.reward_fn_key,
                   max_prompt_length=data_cfg.max_prompt_length, truncation=data_cfg.truncation,
                   filter_overlong_prompts=data_cfg.filter_overlong_prompts,
                   apply_chat_template=data_cfg.apply_chat_template, return_raw_chat=data_cfg.return_raw_chat,
                   max_samples=max_samples, what=what, require_ground_truth=require_ground_truth,
                   label_key=data_cfg.label_key, default_data_source=data_cfg.default_data_source,
                   input_template=data_cfg.input_template,
                   probs=data_cfg.train_probs if what == "data.train_files" else None,
                   split=data_cfg.train_split if what == "data.train_files" else data_cfg.val_split,
                   seed=data_cfg.seed, processor=processor, image_key=data_cfg.image_key,
                   chat_template_kwargs=dict(data_cfg.apply_chat_template_kwargs), tool_schemas=tool_schemas,
                   agent_names=agent_names, route_key=route_key)
    if ds.num_filtered:
        print(f"{what}: data.filter_overlong_prompts dropped {ds.num_filtered} of {ds.num_rows} prompts longer than "
              f"data.max_prompt_length={data_cfg.max_prompt_length} tokens")
    return ds


class PromptSampler:
    """Indices of the prompts of each step: seeded permutation per epoch, whole batches, resumable."""

    def __init__(self, num_prompts: int, batch_size: int, *, shuffle: bool = True, seed: int = 1):
        if batch_size > num_prompts:
            raise ConfigError(f"data.train_batch_size={batch_size} is larger than the training set "
                              f"({num_prompts} prompts); lower it or add data")
        self.num_prompts, self.batch_size, self.shuffle, self.seed = num_prompts, batch_size, shuffle, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_prompts)
        return np.random.default_rng(self.seed + epoch).permutation(self.num_prompts)

    def next_batch(self) -> list[int]:
        """The next `batch_size` prompt indices; moves to the next epoch when fewer than that remain."""
        if self.index + self.batch_size > self.num_prompts:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        out = self._order[self.index:self.index + self.batch_size].tolist()
        self.index += self.batch_size
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
