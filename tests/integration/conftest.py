import pytest

from tests.server import running_server


@pytest.fixture(scope="session")
def server():  # type: ignore[no-untyped-def]
    """One shared server for the tests that need no special flags."""
    with running_server("--max-num-seqs", "32", "--num-tokenizers", "2") as s:
        yield s
