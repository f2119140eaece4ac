"""A web page on another loopback port tries to complete an admin record, in a real browser.

Usage: browser_attack.py CHROMIUM ADMIN_URL RECORD_ID

Serves a page on a port of its own (another origin, the same site as the admin listener)
whose script, with no user action, sends what a page can send without asking: a `no-cors`
POST of the outcome as text/plain to `/records/{id}/complete`, and one to
`/config/reload`. Prints one JSON line: for each admin request that went out, its URL, the
`Sec-Fetch-Site`, `Origin` and `Content-Type` the browser sent, and the status it got.
"""

import http.server
import json
import sys
import threading

from playwright.sync_api import sync_playwright

chromium, admin, record = sys.argv[1], sys.argv[2].rstrip("/"), sys.argv[3]

PAGE = """<!doctype html><title>loading</title><script>
const admin = %s, id = %s;
const forged = JSON.stringify({status: 201, headers: {"content-type": "application/json"},
  body: '{"id":"forged"}', reason: "a page"});
Promise.allSettled([
  fetch(admin + "/records/" + id + "/complete?reason=a+page",
        {method: "POST", mode: "no-cors", body: forged}),
  fetch(admin + "/config/reload", {method: "POST", mode: "no-cors", body: ""}),
]).then(() => { document.title = "done"; });
</script>""" % (json.dumps(admin), json.dumps(record))


class Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = PAGE.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
threading.Thread(target=server.serve_forever, daemon=True).start()
page_url = "http://127.0.0.1:%d/" % server.server_address[1]

sent = []
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=chromium, headless=True,
                                args=["--no-sandbox", "--disable-gpu"])
    page = browser.new_page()

    # The headers the network stack really sent (Sec-Fetch-Site and Origin are added
    # there), from the DevTools protocol; the status, which the page cannot read (its
    # requests are no-cors), from Playwright.
    urls, wire = {}, {}
    cdp = page.context.new_cdp_session(page)
    cdp.on("Network.requestWillBeSent",
           lambda e: urls.__setitem__(e["requestId"], e["request"]["url"]))
    cdp.on("Network.requestWillBeSentExtraInfo",
           lambda e: wire.__setitem__(e["requestId"],
                                      {k.lower(): v for k, v in e["headers"].items()}))
    cdp.send("Network.enable")
    statuses = {}
    page.on("response", lambda r: statuses.__setitem__(r.url, r.status))
    page.goto(page_url)
    page.wait_for_function("document.title === 'done'", timeout=20000)
    page.wait_for_timeout(200)
    for request_id, url in urls.items():
        if url.startswith(admin):
            h = wire.get(request_id, {})
            sent.append({"url": url, "status": statuses.get(url),
                         "method": h.get(":method"),
                         "sec_fetch_site": h.get("sec-fetch-site"),
                         "origin": h.get("origin"),
                         "content_type": h.get("content-type")})
    browser.close()
server.shutdown()
print(json.dumps({"page": page_url, "sent": sent}))
