"""The scheduler side of kvferry's vLLM connector, without vLLM (requests are read by
attribute: ``request_id``, ``kv_transfer_params``, ``num_prompt_tokens``,
``num_computed_tokens``, ``prompt_token_ids``).

Prefill (producer): a request with ``kv_transfer_params = {"do_remote_decode": true}`` is
saved in the step where its prefill completes (:class:`~kvferry.app.vllm.records.SaveJob` in
the step's metadata); when it finishes, :meth:`PageScheduler.request_finished` keeps its
blocks (True) and returns the decode side's params; the worker reports it sent once every
layer is out, and vLLM frees the blocks.

Decode (consumer): :meth:`PageScheduler.matched_tokens` offers the prompt's tokens for an
asynchronous load when ``do_remote_prefill`` is set (``load_mode="sync"``: all but the last
token, loaded in the step that computes that token); after allocation the load job (local
block ids) goes into the next step's metadata. Bad params are logged with the field at fault
and become a failed load, so ``kv_load_failure_policy`` decides (recompute or fail).

Several KV cache groups (vLLM's hybrid manager; ``groups``, from
:func:`kvferry.app.vllm.groups.describe_groups`): a save carries each group's pages
(:func:`~kvferry.app.vllm.groups.sent_pages`: a sliding-window group only the pages its window
keeps for the prompt's last token, on a decode of the block size the request or the settings say:
``decode_block_size``), a load each group's local blocks. A hybrid load is all but
the prompt's last token (the decode computes that one: groups.py says why), and always
asynchronous (``load_mode="sync"`` is taken as async): vLLM reports a sync load's failure only
as failed blocks, which it refuses with several groups (block ids are unique within a group).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvferry.app.vllm.groups import (
    GroupPages,
    GroupSpec,
    freed_at_finish,
    prompt_pages,
    sent_pages,
    state_pages,
    state_prompt_tokens,
)
from kvferry.app.vllm.params import (
    ConnectorSettings,
    DecodeSource,
    PrefillRequest,
    parse_decode_params,
    parse_prefill_params,
    prefill_result,
    recompute_instead,
)
from kvferry.app.vllm.records import LoadJob, SaveJob
from kvferry.core.errors import ConfigError

__all__ = ["PageScheduler", "StepPlan"]

logger = logging.getLogger(__name__)


@attrs.frozen
class StepPlan:
    """What one step's workers do (vLLM's connector metadata wraps it). ``idle``: the step
    runs no tokens (vLLM steps an engine that only waits on its connector's transfers)."""

    saves: tuple[SaveJob, ...] = ()
    loads: tuple[LoadJob, ...] = ()
    idle: bool = False


@attrs.define(eq=False)
class _Pending:
    request: Any
    ask: PrefillRequest
    saved: bool = False


@attrs.define(eq=False)
class PageScheduler:
    """One engine's scheduler-side connector state."""

    settings: ConnectorSettings
    engine_id: str
    block_size: int
    num_layers: int
    tp_size: int
    producer: bool
    consumer: bool
    block_ids_of: Callable[[str], Sequence[int]] = lambda rid: ()
    #: The KV cache groups (hybrid when more than one) and each group's block ids of a request.
    groups: tuple[GroupSpec, ...] = ()
    group_block_ids_of: Callable[[str], Sequence[Sequence[int]]] = lambda rid: ()
    _remote_decode: dict[str, _Pending] = attrs.field(init=False, factory=dict)
    _errors: dict[str, str] = attrs.field(init=False, factory=dict)
    _offers: dict[str, tuple[DecodeSource | None, str | None, int, bool]] = attrs.field(init=False, factory=dict)
    _loads: list[LoadJob] = attrs.field(init=False, factory=list)
    _sending: set[str] = attrs.field(init=False, factory=set)
    #: Remote-decode requests not handed off (``kv_recompute_threshold``): prompt tokens.
    _short: dict[str, int] = attrs.field(init=False, factory=dict)

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups: jobs carry per-group pages."""
        return len(self.groups) > 1

    @property
    def has_state(self) -> bool:
        """A group of recurrent state (Mamba / gated-delta-net): the prefill computes the prompt
        without its last token (groups.state_prompt_tokens)."""
        return any(spec.state for spec in self.groups)

    def _first_pages(self, groups: tuple[GroupPages, ...]) -> tuple[int, ...]:
        """The block ids of the first group of pages of tokens (a job's ``block_ids``)."""
        for spec, pages in zip(self.groups, groups):
            if not spec.state:
                return pages.block_ids
        return groups[0].block_ids

    # ----------------------------------------------------------------------- prefill side
    def new_request(self, request: Any) -> None:
        """vLLM's ``on_new_request``: with a group of recurrent state, a prefill for a remote
        decode (``do_remote_decode``) computes its prompt without the last token, so that the
        state it sends is the one after ``n - 1`` tokens, the decode's to compute the last from
        (groups.py says why). Done once per request (a preempted request is not cut again)."""
        params = request.kv_transfer_params
        if not self.producer or not self.has_state or not isinstance(params, dict):
            return
        if not params.get("do_remote_decode") or params.get("kvferry_state_cut"):
            return
        n = int(request.num_prompt_tokens)
        if recompute_instead(n, self.settings.kv_recompute_threshold):
            return  # not handed off (track): the decode computes the whole prompt
        keep = state_prompt_tokens(n)
        ids = request.prompt_token_ids
        if keep == n or ids is None or len(ids) != n:
            return
        del ids[keep:]
        all_ids = getattr(request, "_all_token_ids", None)
        if all_ids is not None and all_ids is not ids and len(all_ids) == n:
            del all_ids[keep:]
        request.num_prompt_tokens = keep
        if getattr(request, "max_tokens", None) is not None:
            request.max_tokens = 1
        params["kvferry_state_cut"] = True

    def track(self, request: Any) -> None:
        """Note a request scheduled for the first time (a prefill with ``do_remote_decode``)."""
        rid = request.request_id
        if not self.producer or rid in self._remote_decode or rid in self._errors or rid in self._short:
            return
        try:
            ask = parse_prefill_params(request.kv_transfer_params)
        except ConfigError as exc:
            self._errors[rid] = str(exc)
            logger.error("request %s: %s (computed without a remote decode)", rid, exc)
            return
        if ask is None:
            return
        n = int(request.num_prompt_tokens)
        if recompute_instead(n, self.settings.kv_recompute_threshold):
            self._short[rid] = n
            logger.debug(
                "request %s: %d prompt tokens < kv_recompute_threshold %d: not handed off",
                rid,
                n,
                self.settings.kv_recompute_threshold,
            )
            return
        self._remote_decode[rid] = _Pending(request, ask)

    def build_plan(self, scheduled: dict[str, int]) -> StepPlan:
        """This step's saves (requests whose prefill completes with ``scheduled`` tokens) and
        the loads decided since the last step; resets the loads."""
        saves = []
        for rid, pending in self._remote_decode.items():
            n = scheduled.get(rid, 0)
            req = pending.request
            if pending.saved or not n or req.num_computed_tokens + n < req.num_prompt_tokens:
                continue
            groups: tuple[GroupPages, ...] = ()
            decode_bs = pending.ask.decode_block_size or self.settings.decode_block_size or self.block_size
            if self.hybrid:
                groups = self._group_saves(rid, req.num_prompt_tokens, decode_bs)
                if not groups:
                    continue
                blocks = self._first_pages(groups)
            else:
                pages = prompt_pages(req.num_prompt_tokens, self.block_size)
                blocks = tuple(int(b) for b in list(self.block_ids_of(rid))[:pages])
                if len(blocks) < pages:
                    logger.error(
                        "request %s: %d blocks for %d prompt tokens; not sent", rid, len(blocks), req.num_prompt_tokens
                    )
                    continue
            pending.saved = True
            decode_tp = pending.ask.decode_tp_size or self.settings.decode_tp_size or self.tp_size
            tid = pending.ask.transfer_id or rid
            n_tokens = req.num_prompt_tokens
            hold = any(freed_at_finish(spec, n_tokens, decode_bs) for spec in self.groups) if groups else False
            ends_now = getattr(req, "max_tokens", None) == 1
            saves.append(SaveJob(rid, tid, blocks, req.num_prompt_tokens, decode_tp, groups, hold, ends_now))
        loads, self._loads = tuple(self._loads), []
        return StepPlan(tuple(saves), loads, idle=not any(scheduled.values()))

    def _group_saves(self, rid: str, num_tokens: int, decode_block_size: int) -> tuple[GroupPages, ...]:
        """Each group's sent pages of a prompt of ``num_tokens`` tokens for a decode of
        ``decode_block_size`` (groups.window_first_page); () (logged) when a group holds fewer
        blocks than the prompt's pages."""
        per_group = list(self.group_block_ids_of(rid))
        out = []
        for spec in self.groups:
            ids = per_group[spec.index] if spec.index < len(per_group) else ()
            pages = sent_pages(spec, ids, num_tokens, decode_block_size)
            if pages is None:
                logger.error(
                    "request %s: group %d holds %d blocks for %d prompt tokens; not sent",
                    rid,
                    spec.index,
                    len(ids),
                    num_tokens,
                )
                return ()
            out.append(pages)
        return tuple(out)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """``(keep_blocks, kv_transfer_params)`` for a finished request."""
        rid = request.request_id
        self._offers.pop(rid, None)
        error = self._errors.pop(rid, None)
        if error is not None:
            return False, {"kvferry_error": error}
        short = self._short.pop(rid, None)
        if short is not None:  # the decode side reads this as "compute the prompt yourself"
            return False, {
                "do_remote_prefill": False,
                "do_remote_decode": False,
                "kvferry_not_sent": f"{short} prompt tokens < kv_recompute_threshold "
                f"{self.settings.kv_recompute_threshold}: the decode computes the prompt",
            }
        pending = self._remote_decode.pop(rid, None)
        if pending is None or not pending.saved:
            return False, None
        self._sending.add(rid)
        decode_tp = pending.ask.decode_tp_size or self.settings.decode_tp_size or self.tp_size
        return True, prefill_result(
            transfer_id=pending.ask.transfer_id or rid,
            host=self.settings.host,
            port=self.settings.sender_port(0, self.tp_size),
            num_tokens=pending.request.num_prompt_tokens,
            block_size=self.block_size,
            num_layers=self.num_layers,
            tp_size=self.tp_size,
            decode_tp_size=decode_tp,
            connector_type=self.settings.connector_type,
            engine_id=self.engine_id,
        )

    def sent(self, req_ids: Sequence[str] | set[str] | None) -> None:
        """Workers reported these requests sent (their blocks are freed now)."""
        self._sending.difference_update(req_ids or ())

    @property
    def pending_sends(self) -> bool:
        return bool(self._sending)

    # ------------------------------------------------------------------------ decode side
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: ``(tokens to load, asynchronously?)``."""
        self.track(request)
        params = request.kv_transfer_params
        if not self.consumer or not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        prompt = len(request.prompt_token_ids or ())
        try:
            source = parse_decode_params(params)
            error = None
        except ConfigError as exc:
            source, error = None, str(exc)
        if source is None and error is None:
            return 0, False
        tokens = prompt if source is None else min(source.num_tokens, prompt)
        remote = tokens - num_computed_tokens  # what a load would bring
        mode = (source.load_mode if source is not None else None) or self.settings.load_mode
        if self.hybrid:  # all but the last token, asynchronously (the module's docstring)
            mode, tokens = "async", min(tokens, prompt - 1)
        if mode == "sync":  # vLLM computes at least the prompt's last token in this step
            tokens = min(tokens, prompt - 1)
        count = tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        if source is not None and recompute_instead(remote, self.settings.kv_recompute_threshold):
            logger.debug(
                "request %s: %d remote tokens < kv_recompute_threshold %d: computed here",
                request.request_id,
                remote,
                self.settings.kv_recompute_threshold,
            )
            return 0, False
        self._offers[request.request_id] = (source, error, num_computed_tokens, mode == "sync")
        return count, mode != "sync"

    @staticmethod
    def _load_pages(
        spec: GroupSpec, group_block_ids: Sequence[Sequence[int]], first: int, last: int, tokens: int
    ) -> GroupPages | None:
        """One group's blocks a load writes: pages ``first .. last - 1``, or a group of
        recurrent state's one block for the ``tokens`` tokens the load brings."""
        ids = list(group_block_ids[spec.index])
        if spec.state:
            return state_pages(spec, ids, tokens)
        return GroupPages(spec.index, first, tuple(int(b) for b in ids[first:last]))

    def after_alloc(
        self,
        request: Any,
        block_ids: Sequence[int],
        num_external_tokens: int,
        group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        """vLLM's ``update_state_after_alloc``: plan the load into ``block_ids`` (all of the
        request's blocks; with several groups ``group_block_ids``, each group's) and mark the
        params used (a recompute after a failure loads nothing)."""
        rid = request.request_id
        offer = self._offers.pop(rid, None)
        if offer is None or num_external_tokens <= 0:
            return
        source, error, computed, sync = offer
        first = computed // self.block_size
        last = -(-(computed + num_external_tokens) // self.block_size)
        groups: tuple[GroupPages, ...] = ()
        if self.hybrid:
            upto = computed + num_external_tokens
            found = [self._load_pages(spec, group_block_ids, first, last, upto) for spec in self.groups]
            if any(p is None for p in found):
                error = error or "a group of recurrent state holds no block for the loaded tokens"
            groups = tuple(p or GroupPages(spec.index, 0, ()) for spec, p in zip(self.groups, found))
            blocks = self._first_pages(groups)
        else:
            blocks = tuple(int(b) for b in list(block_ids)[first:last])
        if error is not None:
            logger.error("request %s: bad kv_transfer_params: %s", rid, error)
        tokens = computed + num_external_tokens if self.has_state else None
        self._loads.append(LoadJob(rid, source, blocks, first, error, sync, groups, tokens))
        params = request.kv_transfer_params
        if isinstance(params, dict):
            params["do_remote_prefill"] = False
