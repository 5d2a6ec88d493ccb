"""Asyncio tasks of the serving layer that must outlive the request that started them."""

from __future__ import annotations

import asyncio
import contextvars


def detached_task(coro) -> asyncio.Task:
    """A task in a context of its own. A task copies the context current at its creation, so
    one created while serving an HTTP request would be that request's child, and Serve cancels
    a request's children when its client leaves. (Python 3.10's create_task has no context=.)"""
    return contextvars.Context().run(asyncio.get_running_loop().create_task, coro)
