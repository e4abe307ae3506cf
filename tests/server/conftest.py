"""A real Strand server on the default model, as a subprocess shared by the server tests."""

import pytest

from server_helpers import start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The base URL of a server on the default model; SIGTERMed at the end of the session."""
    handle = start_server(tmp_path_factory.mktemp("server"))
    yield handle
    code, alive = stop_server(handle)
    assert code == 0, f"server exited with {code}:\n{handle.log()[-3000:]}"
    assert not alive, f"child processes left after SIGTERM: {alive}"


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url
