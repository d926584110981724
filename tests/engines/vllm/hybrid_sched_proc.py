"""vLLM's real scheduler and KV cache manager over a hybrid ``KVCacheConfig``, with kvferry's
connector on its scheduler side. No model and no worker: the steps' model outputs are written
here (one sampled token per request, the connector's finished/failed sets).

Run by the vLLM venv's interpreter (KVFERRY_VLLM_PYTHON), never imported by pytest:

    python hybrid_sched_proc.py OUT_JSON

The config: 4 layers, group 0 full attention (layers 0, 2), group 1 a sliding window of
``WINDOW`` tokens (layers 1, 3), block size 16. Cases (each a key of the JSON):

- ``prefill``: for each prompt length (and with chunked prefill), the save job's pages per group,
  vLLM's block ids of the request at the save and at ``request_finished_all_groups``, and the
  pool's free blocks before, while held, and after the connector reports the request sent;
- ``decode``: the load job's per-group blocks against the manager's, the request's state, and
  what a failed load (``failed_recving``) does under each ``kv_load_failure_policy``;
- ``mamba``: the same over a config of a full-attention group and a Mamba group (mode
  ``none``: one state block of the model's length per request): the prefill's cut prompt, its
  save's state block against the manager's, the decode's load job and what vLLM schedules next;
- ``refused``: the ConfigError of a Mamba group in mode ``align``, a chunked-local group, groups
  of two block sizes, and of layers whose pages differ in shape at register.
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any

BS, WINDOW, LAYERS, NUM_BLOCKS = 16, 48, 4, 96
MAX_LEN = 1024  # the model's length: a Mamba group's block size in mode "none"


def _vllm_config(role: str, policy: str = "recompute", max_batched: int = 2048) -> Any:
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    path = tempfile.mkdtemp()
    LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
    ).save_pretrained(path)
    model = ModelConfig(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_batched,
        max_model_len=1024,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    transfer = KVTransferConfig(
        kv_connector="KVFerryConnector",
        kv_connector_module_path="kvferry.app.vllm",
        kv_role=role,
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"host": "127.0.0.1", "base_port": 50161, "kv_recompute_threshold": 0},
    )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False),
        scheduler_config=sched,
        kv_transfer_config=transfer,
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config


def _spec(kind: str, block_size: int = BS) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    common = {"block_size": block_size, "num_kv_heads": 2, "head_size": 32, "dtype": torch.bfloat16}
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "swa":
        return SlidingWindowSpec(**common, sliding_window=WINDOW)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=64)
    # a Mamba2 layer's conv state (kernel - 1, conv dims) and SSM state (heads, head dim, state),
    # padded to the attention page (vLLM's one page size): 2 * 16 * 64 * 2 bytes
    mode = "align" if kind == "mamba_align" else "none"
    return MambaSpec(
        block_size=block_size,
        shapes=((3, 96), (4, 16, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=2 * BS * 64 * 2,
        mamba_cache_mode=mode,
    )


def _kv_config(second: str = "swa", second_block_size: int = BS) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    if second.startswith("mamba"):
        names = [n if i % 2 == 0 else f"model.layers.{i}.mixer" for i, n in enumerate(names)]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([names[0], names[2]], _spec("full")),
            KVCacheGroupSpec([names[1], names[3]], _spec(second, second_block_size)),
        ],
    )


def _scheduler(role: str, second: str = "swa", **kw: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = _vllm_config(role, **kw)
    kv = _kv_config(second, MAX_LEN if second == "mamba" else BS)
    # the engine's (EngineCore): the LCM of the groups' block sizes (1024 with the Mamba group)
    bs, hash_bs = resolve_kv_cache_block_sizes(kv, config)
    return Scheduler(
        config, kv, StructuredOutputManager(config), block_size=bs, hash_block_size=hash_bs, log_stats=False
    )


def _request(rid: str, n: int, params: dict | None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params} if params else None)
    return Request(rid, [1 + i % 500 for i in range(n)], sp, None)


def _output(rids: list[str], *, sampled: bool = True, **connector: Any) -> Any:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=rids,
        req_id_to_index={r: i for i, r in enumerate(rids)},
        sampled_token_ids=[[7] if sampled else [] for _ in rids],
        kv_connector_output=KVConnectorOutput(**connector) if connector else None,
    )


def _finished_calls(sched: Any) -> list[Any]:
    """Record every ``request_finished_all_groups`` call the scheduler makes (and any plain one)."""
    calls: list[Any] = []
    conn = sched.connector
    all_groups, single = conn.request_finished_all_groups, conn.request_finished

    def record_all(request: Any, block_ids: Any) -> Any:
        calls.append(("all_groups", request.request_id, [list(b) for b in block_ids]))
        result = all_groups(request, block_ids)
        conn.kvferry_results = [*getattr(conn, "kvferry_results", []), result[1]]
        return result

    def record_single(request: Any, block_ids: Any) -> Any:
        calls.append(("single", request.request_id, list(block_ids)))
        return single(request, block_ids)

    conn.request_finished_all_groups, conn.request_finished = record_all, record_single
    return calls


def _plan(out: Any) -> Any:
    return out.kv_connector_metadata.plan


def prefill_case(n: int, max_batched: int = 2048, second: str = "swa") -> dict:
    sched = _scheduler("kv_producer", second, max_batched=max_batched)
    calls = _finished_calls(sched)
    pool = sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    rid = f"p{n}"
    sched.add_request(_request(rid, n, {"do_remote_decode": True}))
    prompt = sched.requests[rid].num_prompt_tokens  # a Mamba prefill computes all but the last
    saves, steps, at_save = [], 0, None
    while not saves and steps < 20:
        out = sched.schedule()
        steps += 1
        saves = list(_plan(out).saves)
        if saves:
            at_save = [list(b) for b in sched.kv_cache_manager.get_block_ids(rid)]
        # the step's forward ends: a token is sampled only when the prompt is done
        done = sched.requests[rid].num_computed_tokens >= prompt
        sched.update_from_output(out, _output([rid], sampled=done))
    held = pool.get_num_free_blocks()
    finished = rid not in sched.requests or sched.requests[rid].is_finished()
    pending = sched.connector.has_pending_push_work()
    out = sched.schedule()  # the worker reports the request sent in this step's output
    sched.update_from_output(out, _output([], finished_sending={rid}))
    [job] = saves
    return {
        "n": n,
        "prompt": prompt,
        "job_tokens": job.num_tokens,
        "finished_after_save": finished,
        "result_tokens": [(r or {}).get("remote_num_tokens") for r in getattr(sched.connector, "kvferry_results", [])],
        "steps": steps,
        "groups": [[g.group, g.first_page, list(g.block_ids)] for g in job.groups],
        "block_ids": list(job.block_ids),
        "hold_step": job.hold_step,
        "at_save": at_save,
        "calls": calls,
        "free": [free0, held, pool.get_num_free_blocks()],
        "pending_push": pending,
        "after_push": sched.connector.has_pending_push_work(),
        "null_block_id": pool.null_block.block_id,
    }


def _decode_params(n: int, load_mode: str | None) -> dict:
    from kvferry.app.vllm.params import prefill_result

    params = prefill_result(
        transfer_id="t",
        host="127.0.0.1",
        port=50151,
        num_tokens=n,
        block_size=BS,
        num_layers=LAYERS,
        tp_size=1,
        decode_tp_size=1,
        connector_type="memory",
        engine_id="e",
    )
    if load_mode is not None:
        params["load_mode"] = load_mode
    return params


def decode_case(
    n: int, load_mode: str | None, outcome: str, policy: str = "recompute", second: str = "swa", sent: int | None = None
) -> dict:
    from vllm.v1.request import RequestStatus

    sched = _scheduler("kv_consumer", second, policy=policy)
    pool = sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    rid = f"d{n}"
    req = _request(rid, n, _decode_params(n if sent is None else sent, load_mode))
    sched.add_request(req)
    out = sched.schedule()
    [load] = _plan(out).loads
    blocks = [list(b) for b in sched.kv_cache_manager.get_block_ids(rid)]
    row = {
        "n": n,
        "groups": [[g.group, g.first_page, list(g.block_ids)] for g in load.groups],
        "sync": load.sync,
        "upto_tokens": load.upto_tokens,
        "error": load.error,
        "manager": blocks,
        "status": str(req.status),
        "waiting_for_kv": req.status == RequestStatus.WAITING_FOR_REMOTE_KVS,
        "scheduled": dict(out.num_scheduled_tokens),
        "loaded_groups": list(sched.connector.get_loaded_kv_cache_group_ids(req)),
    }
    failed = {rid} if outcome == "failed" else set()
    sched.update_from_output(out, _output([], finished_recving={rid}, failed_recving=failed))
    row["computed_at_load"] = req.num_computed_tokens
    out = sched.schedule()
    row["computed_after_load"] = req.num_computed_tokens
    row["next_scheduled"] = dict(out.num_scheduled_tokens)
    row["next_loads"] = len(_plan(out).loads)
    row["finished"] = rid not in sched.requests or sched.requests[rid].is_finished()
    row["status_after"] = str(req.status)
    engine_outputs = sched.update_from_output(out, _output(list(out.num_scheduled_tokens)))
    reasons = [str(o.finish_reason) for outs in engine_outputs.values() for o in outs.outputs]
    row["finish_reasons"] = reasons
    row["free"] = [free0, pool.get_num_free_blocks()]
    return row


def refusals() -> dict:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.app.vllm.connector import KVFerryConnector, _layer_groups
    from kvferry.app.vllm.groups import describe_groups
    from kvferry.core.errors import ConfigError

    out: dict[str, str] = {}
    config = _vllm_config("kv_producer")
    for name, kv in (
        ("mamba", _kv_config("mamba_align")),
        ("chunked_local", _kv_config("chunked")),
        ("block_sizes", _kv_config("swa", 32)),
    ):
        try:
            KVFerryConnector(config, KVConnectorRole.SCHEDULER, kv)
            out[name] = "accepted"
        except ConfigError as exc:
            out[name] = f"ConfigError: {exc}"
    try:  # with the scheduler: the engine fails at start
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        Scheduler(config, _kv_config("mamba_align"), StructuredOutputManager(config), block_size=BS)
        out["scheduler_mamba"] = "accepted"
    except Exception as exc:
        out["scheduler_mamba"] = f"{type(exc).__name__}: {exc}"
    groups = describe_groups(_kv_config())
    names = [n for g in groups for n in g.layers]
    caches = {n: torch.zeros(NUM_BLOCKS, 2, BS, 64, dtype=torch.bfloat16) for n in sorted(names)}
    out["layer_groups"] = str(list(_layer_groups(groups, caches)))
    caches[names[-1]] = torch.zeros(NUM_BLOCKS, 1, BS, 128, dtype=torch.bfloat16)
    try:
        _layer_groups(groups, caches)
        out["page_shapes"] = "accepted"
    except ConfigError as exc:
        out["page_shapes"] = f"ConfigError: {exc}"
    return out


def main(path: str) -> None:
    from kvferry.app.vllm.connector import KVFerryConnector

    result = {
        "supports_hma": __import__(
            "vllm.distributed.kv_transfer.kv_connector.v1.base", fromlist=["supports_hma"]
        ).supports_hma(KVFerryConnector),
        "hma_enabled": not _vllm_config("kv_producer").scheduler_config.disable_hybrid_kv_cache_manager,
        "prefill": [prefill_case(n) for n in (20, 47, 48, 49, 63, 64, 65, 100, 130)],
        "prefill_chunked": prefill_case(130, max_batched=48),
        "decode": {
            "ok": decode_case(100, None, "ok"),
            "sync_as_async": decode_case(100, "sync", "ok"),
            "failed_recompute": decode_case(100, None, "failed", "recompute"),
            "failed_fail": decode_case(100, None, "failed", "fail"),
            "short": decode_case(40, None, "ok"),
        },
        "mamba": {
            "prefill": [prefill_case(n, second="mamba") for n in (20, 100, 130)],
            "prefill_chunked": prefill_case(130, max_batched=48, second="mamba"),
            "decode": decode_case(100, None, "ok", second="mamba", sent=99),
            "decode_failed": decode_case(100, None, "failed", second="mamba", sent=99),
        },
        "refused": refusals(),
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
