"""The request-id grammar (trainer.loop.request_id): every form the pipeline writes reads back the same,
and what it never writes is refused."""

from __future__ import annotations

import pytest

from streamrl_cli.trainer.loop.request_id import RequestId


@pytest.mark.parametrize(
    "text,fields",
    [
        ("it0/c/1", dict(iteration=0, prompt_id="c/1")),
        ("it12/gsm8k/test/7", dict(iteration=12, prompt_id="gsm8k/test/7")),
        ("it3/c/1~2", dict(iteration=3, prompt_id="c/1", draw=2)),
        ("it3/c/1~12", dict(iteration=3, prompt_id="c/1", draw=12)),
        ("it1/c/1~c", dict(iteration=1, prompt_id="c/1", carried=1)),
        ("it1/c/1~2~c~c", dict(iteration=1, prompt_id="c/1", draw=2, carried=2)),
        ("it0/c/1#r3", dict(iteration=0, prompt_id="c/1", retry=3)),
        ("it0/c/1~2#r1", dict(iteration=0, prompt_id="c/1", draw=2, retry=1)),
        ("it2/c/4~c#p7", dict(iteration=2, prompt_id="c/4", carried=1, resume=7)),
        ("it2/c/4#p0", dict(iteration=2, prompt_id="c/4", resume=0)),
    ],
)
def test_every_form_reads_back_the_same(text, fields):
    rid = RequestId.parse(text)
    assert rid == RequestId(**fields)
    assert str(rid) == text
    assert RequestId.parse(str(rid)) == rid


def test_group_draw_key_and_derived_ids():
    rid = RequestId.parse("it4/c/9~2~c#p5")
    assert str(rid.group) == "it4/c/9~2~c" and rid.group.is_group and not rid.is_group
    assert rid.draw_key == "c/9~2~c"
    assert str(rid.group.retried(2)) == "it4/c/9~2~c#r2"
    assert str(rid.resumed(6)) == "it4/c/9~2~c#p6"
    assert str(rid.in_batch(5)) == "it5/c/9~2~c"
    assert str(rid.in_batch(5).carried_again()) == "it5/c/9~2~c~c"
    assert RequestId(iteration=0, prompt_id="c/1", draw=1).draw_key == "c/1"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "c/1",
        "it/c/1",
        "itx/c/1",
        "it01/c/1",
        "it-1/c/1",
        "it0c/1",
        "eval0/c/1",
        " it0/c/1",
        "it0c/1#r1",
        "it1.5/c/1",
    ],
)
def test_malformed_ids_are_refused(text):
    with pytest.raises(ValueError, match="not a request id"):
        RequestId.parse(text)


def test_ids_the_grammar_cannot_say_are_refused():
    with pytest.raises(ValueError):
        RequestId(iteration=0, prompt_id="c/1", retry=1, resume=1)
    with pytest.raises(ValueError):
        RequestId(iteration=0, prompt_id="c/1", draw=0)
    with pytest.raises(ValueError):
        RequestId(iteration=-1, prompt_id="c/1")


@pytest.mark.parametrize("pid", ["", "a#b", "x~1", "a~c~2", "c/1#r", "c/1#r01", "a b/ü"])
def test_a_datasets_own_prompt_id_reads_back_whatever_it_holds(pid):
    """A record's `id` is the dataset's: the suffixes are read from the end, the rest is the id. One
    that ends like a suffix ("a~c~2") may read back split differently, but as the same group and draw."""
    for rid in (
        RequestId(iteration=3, prompt_id=pid),
        RequestId(iteration=3, prompt_id=pid, draw=2, retry=1),
    ):
        back = RequestId.parse(str(rid))
        assert str(back) == str(rid) and back.draw_key == rid.draw_key and str(back.group) == str(rid.group)
        assert (back.iteration, back.retry, back.resume) == (rid.iteration, rid.retry, rid.resume)
