"""``members.side_by_side``: a member's sequences forwarded in threads of their own."""

from __future__ import annotations

import threading
import time

import pytest

from tokenfuse.members.side_by_side import SideBySide


class Seq:
    def __init__(self, name: str, new: bool = False) -> None:
        self.name, self.new = name, new


def test_new_sequences_go_first_one_after_another_then_the_rest_in_threads_with_a_share_of_the_cores():
    seen = []
    lock = threading.Lock()

    def forward(st: Seq, threads: int) -> str:
        with lock:
            seen.append((st.name, threads, threading.current_thread().name.startswith("sequence")))
        time.sleep(0.01)
        return st.name.upper()

    side = SideBySide()
    states = [Seq("a"), Seq("b", new=True), Seq("c"), Seq("d", new=True), Seq("e")]
    assert side.run(states, forward, cores=2, new=lambda st: st.new) == ["A", "B", "C", "D", "E"]
    assert seen[:2] == [("b", 2, False), ("d", 2, False)]  # in batch order, on the caller's thread
    assert sorted(seen[2:]) == [("a", 1, True), ("c", 1, True), ("e", 1, True)]
    assert side.side_by_side_calls == 1
    side.close()


@pytest.mark.parametrize("cores, live, threads", [(1, 3, 1), (2, 1, 2), (4, 2, 2), (5, 2, 2), (3, 5, 1)])
def test_workers_are_the_fewer_of_sequences_and_cores(cores, live, threads):
    got = []
    side = SideBySide()
    out = side.run([Seq(str(i)) for i in range(live)], lambda st, n: got.append(n) or st.name, cores=cores,
                   new=lambda st: False)
    assert out == [str(i) for i in range(live)]
    assert set(got) == {threads}
    assert side.side_by_side_calls == (1 if min(live, cores) >= 2 else 0)
    side.close()


def test_an_error_is_raised_only_after_every_forward_has_finished():
    finished = []

    def forward(st: Seq, threads: int) -> str:
        if st.name == "bad":
            raise RuntimeError("decode failed")
        time.sleep(0.05)
        finished.append(st.name)
        return st.name

    side = SideBySide()
    with pytest.raises(RuntimeError, match="decode failed"):
        side.run([Seq("bad"), Seq("slow")], forward, cores=2, new=lambda st: False)
    assert finished == ["slow"]
    side.close()
