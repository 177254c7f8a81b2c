"""The browser harness itself: a page that hangs costs the call that met it, and the next call gets a new browser.

A page stuck in a script (or whose renderer died) answers no call. The call that waits for it fails, naming what it
waited for; the bridge and its Chromium are stopped; and the next call, in the same test or the next, starts both
again, so one hung page cannot fail the tests after it (tests/web/support/browser.py).
"""

from __future__ import annotations

import pytest

from .support import page as P
from .support.browser import BrowserError

pytestmark = pytest.mark.web

HANG = "() => { for (;;) {} }"


def test_a_hung_page_fails_its_call_and_the_next_call_gets_a_new_browser(browser, web_server):
    P.open_page(browser, web_server)
    before = browser.generation
    with pytest.raises(BrowserError) as hung:
        browser.js(HANG, timeout_s=5)
    message = str(hung.value)
    assert "did not answer within 5s" in message and "for (;;)" in message, message
    assert not browser.running()
    assert browser.stopped.startswith("evaluate") and "for (;;)" in browser.stopped

    P.open_page(browser, web_server)  # the next call: a new bridge and browser, and ComfyUI's page on it
    assert browser.generation == before + 1
    assert browser.js("() => app.extensions.some((e) => e.name === 'comfyui-multilora.rows')") is True
