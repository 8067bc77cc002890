"""The one stand-in of the verl agent-loop tests: an LLM server generating from a tiny torch policy.

Everything around it is verl 0.9.1's own: the config composed from verl's ``ppo_trainer.yaml``
(as ``main_ppo`` composes it), ``AgentLoopWorker`` and its agent loops, verl's reward worker
running a reward function loaded by path, verl's tool agent loop with a native tool. Nothing is
downloaded: the tokenizer (byte-level BPE with ChatML specials) and the model config (one
``Qwen2ForCausalLM`` entry) are built in a folder.

``TinyPolicyServer.generate`` answers as ``vLLMHttpServer.generate`` does (a ``TokenOutput`` with
log-probs when asked, ``max_tokens`` bounded by the rollout's lengths), sampling from a small
next-token model seeded by the request, so a step is the same every time. With
``rollout.full_determinism`` verl names each request ``det-{priority}`` (the sample's row in the
step), which is how a test injects a failure into one chosen row (``faults``: row -> kind):

* ``crash``: the server raises (an infrastructure error mid-rollout);
* ``crash_once``: the server raises on the first request of the prompt's text only (one of
  its runs fails, whichever asks first: V1 names all of a prompt's runs alike);
* ``hang``: the server never answers (a timeout, or a cancellation);
* ``flaky``: the server raises on the row's first request only (a retry succeeds);
* ``tool``: the first answer is a tool call (``sandbox``), for verl's tool agent loop;
* ``sandbox``: a tool call whose sandbox dies when it is released (the tool raises
  ``SandboxError`` out of verl's tool agent loop, which catches only ``execute``'s errors);
* ``sandbox_hang``: a tool call whose sandbox never answers;
* ``tools3``: the first three answers are tool calls (a conversation of four model calls);
* ``tools2_crash``: the first two answers are tool calls, and the server crashes on the third
  request (a run that dies after two calls of four).

Rows in ``spanning`` see a weight update mid-rollout: their first request is served by the weights
of step ``global_step - 1`` and every later one by ``global_step`` (verl stamps each answer's
``global_steps``; its server client turns them into ``min_global_steps`` / ``max_global_steps``).

A prompt whose text contains ``[kind]`` fails so in every row (what a Ray worker in another
process sees, without the in-process plan).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sessions import SandboxError
from tests import REPO

ROOT = REPO
REWARD_FN = str(Path(__file__).resolve().parent / "reward_fn.py")
PROMPT_LENGTH, RESPONSE_LENGTH = 96, 64
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
TOOL_CALL = '<tool_call>{"name": "sandbox", "arguments": {"code": "1 + 1"}}</tool_call>'
_MARK = re.compile(
    r"\[(crash_once|crash|hang|flaky|tools3|tools2_crash|tool|sandbox|sandbox_hang)\]"
)
#: fault -> how many of the first answers are tool calls
TOOL_TURNS = {"tool": 1, "sandbox": 1, "sandbox_hang": 1, "tools3": 3, "tools2_crash": 2}

#: row (the request's priority) -> injected fault, for the sandbox tool in this process
TOOL_FAULTS: dict[int, str] = {}


# ------------------------------------------------------------------ tokenizer and model folder
def build_model_folder(folder: Path) -> Path:
    """A tokenizer and a model config verl's ``HFModelConfig`` loads, made here, nothing fetched."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["what is 1 + 1 ?", "the answer is 2", "user assistant system tool", TOOL_CALL]
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(fast),
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tools.yaml").write_text(
        "tools:\n"
        "  - class_name: tests.integrations.verl.llm_server.SandboxTool\n"
        "    config: {type: native}\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: sandbox\n"
        "        description: run code in a sandbox\n"
        "        parameters: {type: object, properties: {code: {type: string, description: code}}, required: [code]}\n"
    )
    return folder


def verl_config(model: Path, overrides: Sequence[str] = ()) -> Any:
    """verl's ``ppo_trainer`` config as ``main_ppo`` composes it, for a CPU rollout of ``model``."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
                f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.rollout.val_kwargs.n=4",
                "actor_rollout_ref.rollout.full_determinism=True",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={model / 'tools.yaml'}",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
                f"reward.custom_reward_function.path={REWARD_FN}",
                "trainer.experiment_name=agent-loop-test",
                *overrides,
            ],
        )


# ------------------------------------------------------------------------------- the policy
class TinyPolicy(torch.nn.Module):
    """A next-token model small enough to sample on CPU in microseconds: logits from the last
    token's embedding, the end-of-turn token favoured so answers stay short."""

    def __init__(self, vocab: int, eos: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.Parameter(torch.randn(vocab, 16, generator=generator) * 0.7)
        self.head = torch.nn.Parameter(torch.randn(16, vocab, generator=generator) * 0.7)
        self.eos = eos

    def log_probs(self, last: int, temperature: float) -> torch.Tensor:
        logits = self.embedding[last] @ self.head
        logits[self.eos] += 2.5
        return torch.log_softmax(logits / max(temperature, 1e-4), -1)

    @torch.no_grad()
    def sample(
        self, prompt: Sequence[int], max_tokens: int, temperature: float, seed: int
    ) -> tuple[list[int], list[float]]:
        generator = torch.Generator().manual_seed(seed)
        last, ids, log_probs = prompt[-1], [], []
        for _ in range(max_tokens):
            lp = self.log_probs(last, temperature)
            token = int(torch.multinomial(lp.exp(), 1, generator=generator))
            ids.append(token)
            log_probs.append(float(lp[token]))
            last = token
            if token == self.eos:
                break
        return ids, log_probs

    @torch.no_grad()
    def score(
        self, prompt: Sequence[int], forced: Sequence[int], temperature: float
    ) -> list[float]:
        """The policy's log-probs of ``forced`` (a scripted answer, such as a tool call)."""
        last, out = prompt[-1], []
        for token in forced:
            out.append(float(self.log_probs(last, temperature)[token]))
            last = token
        return out


def _seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


class TinyPolicyServer:
    """What ``vLLMHttpServer`` is to verl's agent loops: ``generate`` -> ``TokenOutput``."""

    def __init__(
        self,
        model: Path | str,
        faults: Mapping[int, str] | None = None,
        global_step: int = 0,
        spanning: Sequence[int] = (),
    ) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.policy = TinyPolicy(len(self.tokenizer), self.tokenizer.eos_token_id)
        self.faults = dict(faults or {})
        self.global_step = global_step
        self.spanning = frozenset(spanning)
        self.requests: dict[str, int] = {}
        self.crashed_once: set[str] = set()

    def fault(self, request_id: str, prompt_ids: Sequence[int]) -> str | None:
        match = re.fullmatch(r"det-(\d+)", request_id)
        if match and int(match.group(1)) in self.faults:
            return self.faults[int(match.group(1))]
        found = _MARK.search(self.tokenizer.decode(prompt_ids))
        return found.group(1) if found else None

    async def generate(
        self,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        **_: Any,
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        await asyncio.sleep(0)
        turn = self.requests[request_id] = self.requests.get(request_id, 0) + 1
        fault = self.fault(request_id, prompt_ids)
        if fault == "crash":
            raise RuntimeError(f"injected: the LLM server crashed on {request_id}")
        if fault == "crash_once":
            text = self.tokenizer.decode(prompt_ids)
            if text not in self.crashed_once:
                self.crashed_once.add(text)
                raise RuntimeError(f"injected: the LLM server crashed once on {request_id}")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "flaky" and turn == 1:
            raise ConnectionError(f"injected: the LLM server dropped {request_id} once")
        if fault == "tools2_crash" and turn == 3:
            raise RuntimeError(f"injected: the LLM server crashed on call 3 of {request_id}")
        temperature = float(sampling_params.get("temperature") or 0.0) or 1.0
        budget = min(RESPONSE_LENGTH, PROMPT_LENGTH + RESPONSE_LENGTH - len(prompt_ids))
        if turn <= TOOL_TURNS.get(fault or "", 0):
            ids = self.tokenizer.encode(TOOL_CALL) + [self.tokenizer.eos_token_id]
            log_probs = self.policy.score(prompt_ids, ids, temperature)
        else:
            ids, log_probs = self.policy.sample(
                prompt_ids, max(1, budget), temperature, _seed(request_id, turn, len(prompt_ids))
            )
        return TokenOutput(
            token_ids=ids[:budget],
            log_probs=log_probs[:budget] if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": self._version(request_id, turn)},
        )

    def _version(self, request_id: str, turn: int) -> int:
        """The weights version serving this request (a spanning row's first: the step before)."""
        match = re.fullmatch(r"det-(\d+)", request_id)
        row = int(match.group(1)) if match else None
        return self.global_step - 1 if row in self.spanning and turn == 1 else self.global_step


class _Remote:
    """``handle.method.remote(...)`` for an object in this process, as a Ray handle spells it."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method(*args, **kwargs)


class InProcessHandle:
    """An in-process object behind the call syntax of a Ray actor handle."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self._target, name))


def llm_client(config: Any, server_handle: Any) -> Any:
    """verl's ``LLMServerClient`` routing every request to one server (no load balancer)."""
    from verl.workers.rollout.llm_server import LLMServerClient

    class OneServerClient(LLMServerClient):
        def __init__(self, config: Any, handle: Any) -> None:
            super().__init__(config)
            self.handle = handle

        async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
            return "tiny-policy", self.handle

        def _release_server(self, server_id: str, request_id: str | None = None) -> None:
            pass

    return OneServerClient(config, server_handle)


def reward_handles(config: Any) -> list[Any]:
    """verl's own ``RewardLoopWorker`` (the reward function loaded by path), in this process."""
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    return [InProcessHandle(RewardLoopWorker(config))]


# ------------------------------------------------------------------------------- the sandbox
def SandboxTool(config: dict, tool_schema: Any) -> Any:  # noqa: N802 - verl calls it as a class
    """A native verl tool (``BaseTool``) that evaluates arithmetic; its sandbox can die on release
    or never answer. A factory, so this module imports verl only when verl loads the tool."""
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse

    class _SandboxTool(BaseTool):
        def __init__(self, config: dict, tool_schema: Any) -> None:
            super().__init__(config, tool_schema)
            self.dying: set[str] = set()

        async def execute(
            self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
        ) -> tuple[Any, float, dict]:
            fault = _tool_fault(kwargs.get("agent_data"))
            if fault == "sandbox_hang":
                await asyncio.sleep(3600)
            if fault == "sandbox":
                self.dying.add(instance_id)
            return ToolResponse(text="2"), 0.0, {}

        async def release(self, instance_id: str, **kwargs: Any) -> None:
            if instance_id in self.dying:
                self.dying.discard(instance_id)
                raise SandboxError("injected: the sandbox died while being released")

    return _SandboxTool(config, tool_schema)


def _tool_fault(agent_data: Any) -> str | None:
    if agent_data is None:
        return None
    match = re.fullmatch(r"det-(\d+)", str(agent_data.request_id))
    if match and int(match.group(1)) in TOOL_FAULTS:
        return TOOL_FAULTS[int(match.group(1))]
    text = " ".join(str(m.get("content", "")) for m in agent_data.messages)
    found = _MARK.search(text)
    return found.group(1) if found else None


# ------------------------------------------------------------------------------- the batches
def prompt_batch(
    prompts: Sequence[str],
    n: int,
    *,
    step: int,
    validate: bool = False,
    agent: str | None = None,
    ground_truth: Mapping[int, str] | None = None,
    uid_prefix: str = "p",
    priority: bool = True,
) -> Any:
    """A generation batch as verl's trainers hand ``generate_sequences`` one: each prompt's row
    repeated ``n`` times in place, a uid per prompt, and (as ``AgentLoopManager`` adds before
    splitting the batch between its workers) each row's ``priority``."""
    from verl.protocol import DataProto

    rows = [(i, text) for i, text in enumerate(prompts) for _ in range(n)]
    truth = dict(ground_truth or {})

    def column(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    non_tensors = {
        "raw_prompt": column([[{"role": "user", "content": text}] for _, text in rows]),
        "uid": column([f"{uid_prefix}{step}u{i}" for i, _ in rows]),
        "index": column([i for i, _ in rows]),
        "data_source": column(["toy" for _ in rows]),
        "reward_model": column([{"ground_truth": truth.get(i, "2")} for i, _ in rows]),
        "extra_info": column([{} for _ in rows]),
    }
    if agent is not None:
        non_tensors["agent_name"] = column([agent for _ in rows])
    if priority:
        non_tensors["priority"] = np.arange(len(rows), dtype=np.int64)
    return DataProto.from_dict(
        non_tensors=non_tensors, meta_info={"global_steps": step, "validate": validate}
    )
