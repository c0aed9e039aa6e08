"""A real S3 HTTP endpoint for tests: moto's threaded server on 127.0.0.1, on a free port."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_s3_server(buckets: tuple[str, ...] = ()) -> Iterator[str]:
    """Start moto, set dummy credentials, create `buckets`; yield the endpoint URL; stop it after."""
    import s3fs
    from moto.server import ThreadedMotoServer

    saved = {key: os.environ.get(key) for key in DUMMY_CREDENTIALS}
    os.environ.update(DUMMY_CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
        for bucket in buckets:
            fs.mkdir(bucket)
        yield endpoint
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
