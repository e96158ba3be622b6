"""Child process of :class:`tests.support.moto_s3.MotoS3Server`: moto's S3 server on 127.0.0.1, any port.

Prints the port it bound on one line, serves until its standard input closes (the parent exited or
stopped it), then shuts down. Run as a script, so it needs nothing from the test tree.
"""

from __future__ import annotations

import os
import sys

from moto.server import ThreadedMotoServer


def main() -> None:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
    # moto's server.stop() waits out open keep-alive connections (about 5 s at the end of every session);
    # everything it holds is in this process's memory and goes with it.
    os._exit(0)


if __name__ == "__main__":
    main()
