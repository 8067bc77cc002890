"""Open Phoenix's page for one trace in headless Chromium, wait for what a person should see
there, keep a screenshot, and print what the trace's panel shows as JSON.

Run by the Phoenix virtualenv's Python (playwright is installed there, not in the project's):
    python phoenix_page.py URL CHROMIUM SCREENSHOT EXPECTED_TEXT...
Exit 0 with {"url", "body", "dialogs"} on stdout once every expected text is visible (`dialogs`:
the messages of any alert the page raised, which stored text must never do); exit 1 with the
page's text when one is not within the deadline (the screenshot is kept either way).
"""

from __future__ import annotations

import json
import sys

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

DEADLINE_MS = 120_000


def main(url: str, chromium: str, screenshot: str, expected: list[str]) -> int:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox"]
        )
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            dialogs: list[str] = []

            def dismiss(dialog: object) -> None:
                dialogs.append(dialog.message)  # type: ignore[attr-defined]
                dialog.dismiss()  # type: ignore[attr-defined]

            page.on("dialog", dismiss)
            page.goto(url, timeout=DEADLINE_MS)
            missing = None
            try:
                for text in expected:
                    missing = text
                    page.get_by_text(text, exact=False).first.wait_for(
                        state="visible", timeout=DEADLINE_MS
                    )
                missing = None
            except PlaywrightTimeout:
                pass
            page.screenshot(path=screenshot, full_page=False)
            body = page.inner_text("body")
            if missing is not None:
                print(json.dumps({"url": page.url, "missing": missing, "body": body}))
                return 1
            print(json.dumps({"url": page.url, "body": body, "dialogs": dialogs}))
            return 0
        finally:
            browser.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
