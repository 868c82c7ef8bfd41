"""``zaya_jax.load(path)``: a model ready to evaluate, from a run, a checkpoint or an HF directory."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from zaya_jax.config import Config, DataConfig, DataSource, ModelConfig, RuntimeConfig
from zaya_jax.data import DataError
from zaya_jax.data.chat import ChatEncoder, ChatTemplate, stop_ids, tokenizer_chat_template
from zaya_jax.data.sources import source_for_path
from zaya_jax.data.tokenizers import HFTokenizer, Tokenizer, load_tokenizer
from zaya_jax.engine import Engine
from zaya_jax.eval import evaluate
from zaya_jax.files import write_atomic
from zaya_jax.generate import Generation, generate
from zaya_jax.interop.hf import save_hf_directory
from zaya_jax.lora.plan import parameter_plan
from zaya_jax.model import Zaya
from zaya_jax.model.lowrank import merged
from zaya_jax.objectives import GivenData, SavedRun, registered, spec_for
from zaya_jax.objectives.held_out import checked_tokenizer
from zaya_jax.parallel.distributed import enable_compilation_cache
from zaya_jax.pretrained import find_tokenizer, load_model, model_format
from zaya_jax.staging import StagedDirectory, is_empty_dir, same_files
from zaya_jax.train.init import starting_weights


@dataclasses.dataclass
class LanguageModel:
    """A ZAYA1 model and its variables. ``config`` is the model config, ``run_config`` the whole run's."""

    config: ModelConfig
    variables: dict[str, Any]
    run_config: Config | None = None
    step: int | None = None
    tokenizer: Tokenizer | None = None
    tokenizer_problem: str | None = None  # why there is no tokenizer, when there is none

    @functools.cached_property
    def _apply(self):
        return jax.jit(Zaya(self.config).apply)

    def logits(self, ids: npt.ArrayLike, attention_mask: npt.ArrayLike | None = None) -> np.ndarray:
        """Next-token logits, (batch, seq, vocab) float32. ids: (batch, seq) or (seq,) token ids;
        attention_mask: 1 for real tokens, 0 for (left) padding, as in HF.
        """
        ids = np.asarray(ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"ids must be integer token ids of shape (batch, seq), got {ids.dtype} {ids.shape}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}); got {ids.min()}..{ids.max()}"
            )
        mask = None
        if attention_mask is not None:
            mask = jnp.asarray(np.asarray(attention_mask).reshape(ids.shape), jnp.int32)
        logits, _ = self._apply(self.variables, jnp.asarray(ids, jnp.int32), token_mask=mask)
        return np.asarray(logits, dtype=np.float32)

    @functools.cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template the model's conversations are rendered with (the run's chat or
        preference source's ``chat_template``, else its tokenizer's own), None when it has none."""
        return _run_chat_template(self.tokenizer, self.run_config) if self.tokenizer is not None else None

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids generation stops on by default: the model's EOS ids and the tokenizer's (as HF
        ``generate`` stops)."""
        tok = self.tokenizer
        return list(dict.fromkeys([*self.config.stop_token_ids, *([tok.eos_id] if tok is not None else [])]))

    def engine(self, slots: int = 64, prefill_chunk: int = 128, return_routes: bool = False) -> Engine:
        """The rollout engine (:class:`zaya_jax.engine.Engine`) over this model: ``slots`` requests
        in flight, ids the tokenizer cannot decode never generated, stop strings decoded with it."""
        tok = self.tokenizer
        return Engine(
            self.config,
            self.variables,
            slots=slots,
            prefill_chunk=prefill_chunk,
            vocab_limit=tok.vocab_size if tok is not None else None,
            decode=(lambda ids: tok.decode(ids)) if tok is not None else None,
            return_routes=return_routes,
        )

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | np.ndarray,
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_tokens: Sequence[int] | None = None,
        seed: int = 0,
        attention_mask: npt.ArrayLike | None = None,
        mesh: jax.sharding.Mesh | None = None,
        return_routes: bool = False,
        slots: int | None = None,
        capacity: int | None = None,
    ) -> Generation:
        """Continue prompts with the CCA decode cache (see :mod:`zaya_jax.generate`).

        ``prompts``: a string or list of strings (needs ``self.tokenizer``), a list of token-id lists
        (left-padded here), or a (batch, seq) / (seq,) id array with an optional left-padding
        ``attention_mask``. Stops at any of the model's EOS ids (``eos_token_id`` and the
        ``eos_token_ids`` list) and the tokenizer's EOS unless ``stop_tokens`` is given. Returns a
        :class:`Generation`; ``texts`` is filled when a tokenizer is known. ``mesh``: split the decode cache over its ``context`` axis (tree attention).
        ``return_routes``: also the class every layer chose for every token read (router replay,
        :class:`~zaya_jax.generate.Generation`); ``logprobs`` are always returned. ``slots``: rows
        in flight at once in the rollout engine (default: every prompt); ``capacity``: its cache
        slots per row, fixed so that calls of any prompt length share one program.
        """

        tok = self.tokenizer
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
            if tok is None:
                raise ValueError(
                    f"text prompts need a tokenizer: {self.tokenizer_problem or 'this model has none'}; "
                    "pass token ids, or the model's tokenizer (--tokenizer PATH or 'byte', lm.tokenizer)"
                )
            prompts = [tok.encode(p).tolist() for p in prompts]
        if stop_tokens is None:
            stop_tokens = self.stop_token_ids
        out = generate(
            self.config,
            self.variables,
            prompts,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_tokens=stop_tokens,
            seed=seed,
            vocab_limit=tok.vocab_size if tok is not None else None,
            mesh=mesh,
            return_routes=return_routes,
            slots=slots,
            capacity=capacity,
        )
        if tok is None:
            return out
        return dataclasses.replace(
            out, texts=[tok.decode([t for t in row if t != tok.eos_id]) for row in out.rows()]
        )


def load(path: str | Path, tokenizer: str | None = None) -> LanguageModel:
    """Load a run directory (its latest readable checkpoint), a step directory, or an HF
    ``save_pretrained`` directory (converted in memory), through the one loading path of
    :mod:`zaya_jax.pretrained`. Arrays land on the first local device, whatever mesh saved them.
    ``tokenizer`` (``'byte'`` or a tokenizer.json) replaces the model's own (which is then not read).
    The default persistent compilation cache (``runtime.compilation_cache_dir``) is switched on,
    as ``zaya eval`` and ``zaya generate`` run, so evaluating or sampling again compiles nothing.
    """
    enable_compilation_cache(RuntimeConfig().compilation_cache_dir)
    files = load_model(path)
    if tokenizer is not None:
        tok, problem = load_tokenizer(tokenizer), None
    else:
        tok, problem = find_tokenizer(path, files.run)
    variables = jax.tree.map(jnp.asarray, files.variables)
    lm = LanguageModel(files.model, variables, files.run, files.step, tok, problem)
    if tok is not None:
        checked_tokenizer(tok, lm)  # more ids than the model's vocabulary: not its tokenizer
    return lm


def evaluate_path(
    path: str | Path,
    data_paths: Sequence[str] = (),
    tokenizer: str | None = None,
    *,
    seq_len: int | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Held-out loss of a run, checkpoint or HF directory: ``{"loss", "perplexity", "tokens",
    "evaluated"}`` (``evaluated`` says what, in words).

    The tokenizer is ``tokenizer`` if given, else the run's or the HF directory's ``tokenizer.json``
    (an HF directory without one needs ``tokenizer``). A run or checkpoint with no data paths and no
    shape arguments reproduces the run's own held-out evaluation (its ``eval_loss``); otherwise the
    held-out split of the run's data (or the built-in corpus), or all of ``data_paths``, is read in
    order in ``max_batches`` batches (defaults 512 tokens x 8 rows x 16 batches). A run whose
    objective scores files of its own kind (dpo, ipo, simpo: preference pairs) reports its
    held-out evaluation's metrics on ``data_paths`` instead (``ObjectiveSpec.evaluate_data``);
    pairs given to any other model are refused."""
    lm = load(path, tokenizer)
    if lm.tokenizer is None:
        raise ValueError(
            f"{lm.tokenizer_problem}; pass the model's tokenizer (--tokenizer PATH or 'byte'): a tokenizer the "
            "model was not trained with gives a loss that means nothing"
        )
    tok = lm.tokenizer
    shape_given = any(v is not None for v in (seq_len, batch_size, max_batches))
    spec = spec_for(lm.run_config) if lm.run_config is not None else None
    if spec is not None and not data_paths and not shape_given:
        return spec.evaluate_saved(_saved_run(lm, Path(path), tok, progress))
    sources = tuple(source_for_path(p) for p in data_paths)
    if spec is not None and spec.evaluate_data is not None:  # the objective scores files of its own kind
        if not data_paths:
            raise ValueError(
                f"--seq-len, --batch-size and --batches shape --data; a {lm.run_config.train.objective} run's "
                "held-out evaluation is its own: zaya eval RUN without them, or give files with --data"
            )
        given = GivenData(sources, seq_len, batch_size, max_batches)
        return spec.evaluate_data(_saved_run(lm, Path(path), tok, progress), given)
    _refuse_pairs(lm, sources)
    data = lm.run_config.data if lm.run_config is not None else DataConfig()
    split = "held_out"
    if data_paths:
        data = dataclasses.replace(data, sources=sources)
        split = "all"
    shape = {"seq_len": seq_len or 512, "batch_size": batch_size or 8, "max_batches": max_batches or 16}
    result = evaluate(lm, data, split=split, tokenizer=tok, progress=progress, **shape)
    chat = any(s.kind == "chat" for s in data.sources)
    source = (
        ", ".join(data_paths) + (" (chat: the loss on assistant tokens only)" if chat else "")
        if data_paths
        else "the held-out split of "
        + ("the run's data" if lm.run_config is not None else "the built-in corpus")
    )
    what = (
        f"{source}: up to {shape['max_batches']} batches of {shape['batch_size']} x {shape['seq_len']} tokens, "
        "in order"
    )
    return {**result, "evaluated": what}


def _refuse_pairs(lm: LanguageModel, sources: tuple[DataSource, ...]) -> None:
    """Preference pairs given to a model whose ``--data`` is text (an lm or grpo run, an HF directory)."""
    pairs = [s.path for s in sources if s.kind == "preference"]
    if pairs:
        model = (
            f"this {lm.run_config.train.objective} run"
            if lm.run_config is not None
            else "this Hugging Face directory"
        )
        scorers = "/".join(name for name in registered() if spec_for(name).evaluate_data is not None)
        raise ValueError(
            f"{', '.join(pairs)} hold preference pairs, which a {scorers} run scores by its loss (zaya eval RUN "
            f"--data PAIRS.jsonl); --data of {model} scores text (next-token loss): give text, JSONL of "
            '{"text": ...} or chat files'
        )


def _saved_run(lm: LanguageModel, path: Path, tok: Tokenizer, progress: bool) -> SavedRun:
    """A run or step directory as its objective evaluates it: ``evaluate_saved`` (the run's own
    held-out evaluation: the loss for ``lm``, the preference metrics for dpo, ipo and simpo, the mean
    greedy reward of its held-out prompts for grpo) or ``evaluate_data`` (given files; dpo and ipo
    score reference log-probabilities with the run's starting weights)."""
    # A run holds checkpoints/ (its config.yaml may be gone: the checkpoint has its own config); a
    # step directory is checkpoints/<step> inside one.
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
    cfg = lm.run_config
    return SavedRun(
        lm, cfg, run_dir, lm.step, tok, progress,
        starting_weights=lambda programs: starting_weights(
            cfg, programs.init_state(), programs.layout.parameters
        ),
    )  # fmt: skip


def export_hf(
    path: str | Path,
    destination: str | Path,
    dtype: str = "float32",
    *,
    merge: bool = False,
    adapter: bool = False,
    quantize: str | None = None,
) -> tuple[Path, int]:
    """``zaya convert zaya-to-hf``: a run or checkpoint as an HF ``save_pretrained`` directory
    (config, generation config, weights) with the run's tokenizer when it is a ``tokenizer.json``
    (copied, plus a ``tokenizer_config.json`` naming its special tokens), so that ``transformers``
    and ``lm_eval --model hf`` load it with its tokenizer. Returns (directory, step).

    The directory is written beside ``destination`` and renamed into place when complete
    (:mod:`zaya_jax.staging`): a killed export leaves no ``destination`` (or the empty one it
    found), and rerunning it succeeds. When ``destination`` already holds an export, it is exported
    again beside it: byte-identical files leave it as it is; anything else is refused.

    A LoRA run (``lora.rank > 0``) is exported ``merge``d (one HF model whose weights are
    ``W + s A B``, for ``transformers`` and vLLM, whose ZAYA model takes no adapters) or as an
    ``adapter`` (a PEFT directory, :func:`zaya_jax.lora.peft.save_peft_adapter`, for
    ``PeftModel.from_pretrained`` on the HF export of its base); one of the two must be chosen, except
    with ``quantize`` (``fp8-experts``, ``mxfp4-experts``: the experts in that compressed-tensors
    format, :func:`zaya_jax.interop.hf.save_hf_directory`), which merges the adapters first."""
    destination = Path(destination)
    if destination.exists() and not is_empty_dir(destination) and not (destination / "config.json").is_file():
        raise FileExistsError(f"{destination} exists and is not empty; choose a new destination")
    if model_format(path) == "hf":
        raise ValueError(f"{path} is a Hugging Face directory already; give a zaya-jax run or step directory")
    if quantize not in (None, "none") and adapter:
        raise ValueError("--quantize exports a whole model; an adapter (--adapter) is not quantized")
    if merge and adapter:
        raise ValueError(
            "give --merge (one merged HF model) or --adapter (a PEFT adapter directory), not both"
        )
    files = load_model(path)
    variables = files.variables
    parameters = parameter_plan(files.run) if files.run is not None else None
    if parameters is None or not parameters.frozen_base:
        if adapter:
            raise ValueError(f"{path} is not a LoRA run (lora.rank is 0): it has no adapters to export")
    elif adapter:
        with StagedDirectory(destination, "zaya convert zaya-to-hf --adapter") as staged:
            base = files.run.train.init_from if model_format(files.run.train.init_from) == "hf" else None
            parameters.save_adapter(staged.path, files.model, variables["params"], base_model=base)
            staged.publish_or_match(same_files)
        return destination, files.step
    elif not merge and quantize in (None, "none"):
        raise ValueError(
            f"{path} is a LoRA run: give --merge for one HF model with the adapters merged into its weights "
            "(transformers, vLLM), or --adapter for a PEFT adapter directory to load on the HF export of "
            f"its base ({files.run.train.init_from})"
        )
    else:
        variables = {**variables, "params": merged(variables["params"])}
    with StagedDirectory(destination, "zaya convert zaya-to-hf") as staged:
        tok, _ = find_tokenizer(path, files.run)
        template = _run_chat_template(tok, files.run) if tok is not None else None
        model = files.model
        if tok is not None:  # generation stops where the run's rollouts and zaya's sampling stop
            chat = ChatEncoder(tok, template) if template is not None else None
            model = dataclasses.replace(model, eos_token_ids=stop_ids(model.stop_token_ids, tok, chat))
        save_hf_directory(staged.path, model, variables, dtype=dtype, quantize=quantize)
        if isinstance(tok, HFTokenizer):
            write_atomic(staged.path / "tokenizer.json", Path(tok.path).read_bytes())
            names = {
                f"{kind}_token": tok.id_to_token(getattr(tok, f"{kind}_id")) for kind in ("bos", "eos", "pad")
            }
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": files.model.max_position_embeddings,
                **names,
                **({"chat_template": template.source} if template is not None else {}),
            }
            write_atomic(staged.path / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
        staged.publish_or_match(same_files)
    return destination, files.step


def _run_chat_template(tok: Tokenizer, run: Config | None) -> ChatTemplate | None:
    """The chat template the run rendered its conversations with (a chat or preference source's
    ``chat_template`` file, else the tokenizer's own), None when it has none."""
    files = [s.chat_template for s in (run.data.sources if run is not None else ()) if s.chat_template]
    try:
        return tokenizer_chat_template(tok, files[0] if files else None)
    except DataError:
        return None
