"""seams/kwargs.py on its own: what a builder's signature takes, and the message for a key it
does not take (the key as the user wrote it, a close name offered, what it does take)."""

from __future__ import annotations

from ddpflow.core.errors import short
from ddpflow.seams.kwargs import takes, unknown_key


def test_what_a_signature_takes_by_keyword_and_whether_it_takes_any():
    def open_ended(a, b=1, *args, c, **rest):
        return a

    def closed(a, *args, c=0):
        return a

    assert takes(open_ended) == (["a", "b", "c"], True)  # *args is not a keyword
    assert takes(closed) == (["a", "c"], False)
    assert takes(lambda: 0) == ([], False)
    # a callable without a signature (a C builtin) takes anything: nothing can be refused
    assert takes(max) == ([], True)


def test_a_key_not_taken_is_named_as_written_with_a_close_name_and_what_is_taken():
    names = ["self", "num_classes", "in_channels", "width", "depth"]
    assert unknown_key("widht", "smallcnn", names) == (
        "model.kwargs.widht: smallcnn takes no argument widht (did you mean 'width'?); it "
        "takes width, depth")
    assert unknown_key("zzz", "smallcnn", names) == (
        "model.kwargs.zzz: smallcnn takes no argument zzz; it takes width, depth")
    assert unknown_key("x", "net", ["num_classes"]) == (
        "model.kwargs.x: net takes no argument x; it takes none")


def test_a_key_that_is_no_name_is_shown_quoted_and_cut():
    # YAML keys may be numbers or any text: shown as repr, at most 40 characters
    assert unknown_key(3, "net", ["width"]).startswith("model.kwargs.3: net takes no "
                                                       "argument 3;")
    odd = "two words " * 10
    shown = short(odd, 40)
    assert len(shown) == 39 and shown.endswith(" ...")  # 35 characters of its repr, " ..."
    assert unknown_key(odd, "net", ["width"]) == (
        f"model.kwargs.{shown}: net takes no argument {shown}; it takes width")
