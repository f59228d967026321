"""A stand-in for an overloaded S3 server, for s3_test's retry tests only (every other S3 test runs
against s3rver): answers the first FAILURES requests with 503 SlowDown (S3's error document), then
200 with the body b"payload of " + path. Listens on 127.0.0.1 at a port the kernel picks and prints
"PORT <n>"; each request is printed as "REQUEST <method> <path>".

    python3 flaky_server.py FAILURES
"""
import http.server
import sys

failures_left = int(sys.argv[1])


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        global failures_left
        print(f"REQUEST GET {self.path}", flush=True)
        if failures_left > 0:
            failures_left -= 1
            body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                    b"<Message>Please reduce your request rate.</Message></Error>")
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
        else:
            body = b"payload of " + self.path.encode()
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
print(f"PORT {server.server_address[1]}", flush=True)
server.serve_forever()
