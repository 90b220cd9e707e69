"""The store's file locks: owner claims a cleanup can tell from gone owners, and exclusive holds that wait
without blocking the event loop and give up when told to."""

from __future__ import annotations

import asyncio
import fcntl
import os

import pytest

from service.registry.locks import Claim, OwnerCheck, exclusive_async


def test_a_claim_is_live_until_closed_and_then_reaped(tmp_path):
    first, second = Claim(tmp_path), Claim(tmp_path)
    assert first.owner != second.owner and first.path.exists()
    check = OwnerCheck(tmp_path, second.owner)
    assert not check.gone(first.owner) and not check.gone(second.owner)
    assert check.gone("0123456789abcdef"), "an owner without a lock file is gone"
    check.close()
    os.close(first._fd)  # what the kernel does when the owner dies: its lock is let go, its file stays
    first._fd = None
    check = OwnerCheck(tmp_path, second.owner)
    assert check.reap_lock_files() == 1 and check.gone(first.owner)
    check.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{second.owner}.lock"]
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_an_exclusive_hold_waits_for_the_holder_and_gives_up_when_told(tmp_path):
    path = tmp_path / "prepare.lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    order: list[str] = []

    async def waiter() -> None:
        async with exclusive_async(path):
            order.append("got it")

    async def main() -> None:
        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.3)
        order.append("still waiting" if not task.done() else "did not wait")
        os.close(holder)
        await asyncio.wait_for(task, 5)

        again = os.open(path, os.O_RDWR)
        fcntl.flock(again, fcntl.LOCK_EX)

        def stopping() -> None:
            raise RuntimeError("stopping")

        with pytest.raises(RuntimeError, match="stopping"):
            async with exclusive_async(path, give_up=stopping):
                pass
        os.close(again)

    asyncio.run(main())
    assert order == ["still waiting", "got it"]
