"""No empty steps (issue 57 item 4): a piece of an over-long conversation with no assistant token is not
trained, and a step whose blocks hold no supervised token on any rank is not taken, so no step trains nothing
and logs a loss of 0 (an Alpaca file with prompts longer than data.seq_len did, at steps 6, 10 and 11)."""
from __future__ import annotations

import numpy as np
import pytest

from raytune_ft.data.packing import DataCounters, block_from_segments, pack_blocks

SEQ_LEN = 64


@pytest.fixture(scope="module")
def qwen3(fixtures):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen3")


def _alpaca_long_prompt(tok, words: int, answer: str):
    """(ids, mask) of an Alpaca row whose instruction runs over several blocks, rendered by the real template."""
    from raytune_ft.data.sft import render_sft
    from raytune_ft.data.sources import Adapter

    instruction = " ".join(f"word{i} of a long prompt" for i in range(words))
    messages, reason = Adapter("alpaca")({"instruction": instruction, "input": "", "output": answer})
    assert reason is None
    return render_sft(tok, messages)


def test_pieces_of_a_long_prompt_with_no_assistant_token_are_not_trained(qwen3):
    rows = [_alpaca_long_prompt(qwen3, 40 + 7 * i, f"Answer number {i} is short.") for i in range(4)]
    assert all(len(ids) > 3 * SEQ_LEN for ids, _ in rows)
    c = DataCounters()
    blocks = list(pack_blocks(rows, SEQ_LEN, window=8, counters=c))
    # each piece's mask; the first token of a piece is never supervised (it cannot see the text before it)
    pieces = [np.asarray(mask[s:s + SEQ_LEN])[1:] for _, mask in rows for s in range(0, len(mask), SEQ_LEN)]
    kept = sum(bool(p.any()) for p in pieces)
    # every block carries the loss somewhere: none would train nothing
    assert blocks and all((b["labels"] != -100).any() for b in blocks)
    assert c.conversations_split == 4 and c.conversations_packed == kept < len(pieces)
    assert getattr(c, "pieces_unsupervised", None) == len(pieces) - kept
    # nothing supervised is lost: every answer token a piece can learn
    assert c.supervised_tokens == sum(int(p.sum()) for p in pieces) > 0


def test_the_pieces_each_overlong_choice_trains_are_counted_as_packing_keeps_them(qwen3):
    from raytune_ft.data.packing import overlong_pieces

    ids, mask = _alpaca_long_prompt(qwen3, 60, "A short answer.")
    n, trained = overlong_pieces(mask, SEQ_LEN)
    c = DataCounters()
    list(pack_blocks([(ids, mask)], SEQ_LEN, counters=c))
    assert n == -(-len(ids) // SEQ_LEN) and trained == c.conversations_packed == n - c.pieces_unsupervised < n


def _block(first: int, supervised: bool) -> dict:
    """A full block named by its first token; supervised on every token after the first, or on none."""
    return block_from_segments([(np.arange(first, first + 8), np.full(8, supervised))], 8)


def _steps(blocks: list[dict], skip: int = 0, fingerprint=None, rank: int = 0) -> dict:
    from raytune_ft.train.batch import RankSteps, StepFeed

    counters = DataCounters()
    feed = StepFeed(iter(blocks), steps=RankSteps(1, 8, rank=rank), counters=counters, skip_blocks=skip,
                    fingerprint=fingerprint)
    steps, positions = [], []
    while (got := feed.next_blocks()) is not None:
        steps.append([int(b["input_ids"][0]) for b in got])
        positions.append((feed.blocks_consumed, feed.fingerprint))
    return {"steps": steps, "positions": positions, "unsupervised": getattr(counters, "blocks_unsupervised", None)}


def test_a_step_with_no_supervised_token_is_read_past_on_one_rank():
    got = _steps([_block(100, True), _block(200, False), _block(300, False), _block(400, True)])
    assert got["steps"] == [[100], [400]] and got["unsupervised"] == 2
    # a resume after the first step replays it and reads past the same empty steps
    again = _steps([_block(100, True), _block(200, False), _block(300, False), _block(400, True)],
                   *got["positions"][0])
    assert again["steps"] == [[400]] and again["positions"][-1] == got["positions"][-1]


# rank r's blocks, (first token, supervised): step 2 has none on either rank; step 1 on rank 0 alone
RANKS = {0: [(100, True), (200, False), (300, True)], 1: [(1100, False), (1200, False), (1300, True)]}


def _rank_main(rank, world, port, q):
    from tests.conftest import spawned_gloo_rank

    with spawned_gloo_rank(rank, world, port):
        blocks = [_block(f, s) for f, s in RANKS[rank]]
        q.put((rank, _steps(blocks, rank=rank)))
        q.close()
        q.join_thread()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_step_with_no_supervised_token_on_any_rank_is_not_taken_on_every_rank():
    from tests.conftest import run_gloo_ranks

    got = run_gloo_ranks(_rank_main)
    # step 1 is taken (rank 0's block carries the loss: rank 1 trains its own with no loss), step 2 is not
    assert got[0]["steps"] == [[100], [300]] and got[1]["steps"] == [[1100], [1300]]
    assert got[0]["unsupervised"] == got[1]["unsupervised"] == 1


def test_data_check_says_what_each_overlong_choice_trains_as_the_run_packs_it(tmp_path, capsys):
    import json

    from raytune_ft.cli import main
    from raytune_ft.data.sft import render_sft
    from raytune_ft.data.sources import Adapter
    from raytune_ft.models.tiny import local_tokenizer

    rows = [{"instruction": " ".join(f"word{j} of a long prompt number {i}" for j in range(30 + 5 * i)), "input": "",
             "output": f"Answer {i} is short."} for i in range(6)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = local_tokenizer()
    masks = [np.asarray(render_sft(tok, Adapter("alpaca")(r)[0])[1]) for r in rows]
    pieces = [m[s:s + SEQ_LEN][1:] for m in masks for s in range(0, len(m), SEQ_LEN)]
    kept = sum(bool(p.any()) for p in pieces)
    assert 0 < kept < len(pieces)
    args = ["data", "check", "qwen27b_b300", "--local", f"--set=data.source={path}", f"--set=data.seq_len={SEQ_LEN}",
            "--set=data.validation_fraction=0", "--set=train.eval_every=0", "--set=train.sample_prompts=0",
            "--set=data.template_kwargs={}", f"--png={tmp_path / 'h.png'}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (f"overlong         split (this run) trains {kept} of their {len(pieces)} pieces and drops "
            f"{len(pieces) - kept} with no assistant token; drop trains none of them, skipping the 6 rows") in out
    assert f"trained          6 conversations, {kept} pieces packed" in out       # as the run packs them
    assert main(args + ["--set=data.overlong=drop"]) == 1          # every row dropped: a run would stop
    out = capsys.readouterr().out
    assert "drop (this run) trains none of them" in out and "skipped          6 {'overlong': 6}" in out
