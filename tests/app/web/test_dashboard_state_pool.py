"""The dashboard's state pool panel (models with recurrent layers), on the tiny dense model
with a fabricated pool in place of the engine's: the page, its JSON twin, and the dense model's
page without the panel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bs4 import BeautifulSoup
from starlette.testclient import TestClient

from app.settings import Settings
from app.web.app import create_app
from app.web.pages.dashboard import state_pool
from app.web.render import fmt_bytes
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

JSON = {"accept": "application/json"}
USAGE = {"state_slots_total": 4, "state_slots_used": 3, "state_checkpoints": 5,
         "state_checkpoint_capacity": 16, "state_checkpoint_hits": 7,
         "state_slot_bytes": 18 * 2**20}


class FakeSlots:
    """What the dashboard reads of engine/state_slots.py's StateSlots: usage()."""

    def __init__(self, usage: dict[str, int]):
        self.now = dict(usage)

    def usage(self) -> dict[str, int]:
        return dict(self.now)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=32, block_size=4)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model))
    with TestClient(app) as c:
        yield c


@pytest.fixture
def pool(client) -> Iterator[FakeSlots]:
    """The engine given a fabricated state pool for one test (it runs no step meanwhile)."""
    engine = client.app.state.engine
    before = getattr(engine, "state_slots", None)
    engine.state_slots = FakeSlots(USAGE)
    yield engine.state_slots
    engine.state_slots = before


def page(client: TestClient) -> BeautifulSoup:
    response = client.get("/dashboard")
    assert response.status_code == 200
    return BeautifulSoup(response.text, "html.parser")


def test_a_dense_model_has_no_state_pool(client):
    assert client.get("/dashboard", headers=JSON).json()["state"]["state_pool"] is None
    soup = page(client)
    assert soup.select_one("section#kv") is not None
    assert soup.select_one("section#state-pool") is None


def test_the_json_twin_has_the_pool_as_it_is_now(client, pool):
    expected = {"slots_total": 4, "slots_used": 3, "checkpoints": 5, "checkpoint_capacity": 16,
                "checkpoint_hits": 7, "slot_bytes": 18 * 2**20}
    assert client.get("/dashboard.json").json()["state"]["state_pool"] == expected
    pool.now["state_slots_used"] = 1  # a sequence finished: read live, not from a step
    assert client.get("/dashboard.json").json()["state"]["state_pool"]["slots_used"] == 1


def test_the_page_shows_slots_checkpoints_bytes_and_hits(client, pool):
    soup = page(client)
    section = soup.select_one("section#state-pool")
    assert section.h2.get_text() == "State pool"
    assert section.find_parent(class_="stack").select_one("section#kv") is not None  # beside
    assert section.select_one("#state-slots").get_text() == "3 / 4"
    assert section.select_one("#state-ckpt").get_text() == "5 / 16"
    assert section.select_one("#state-hits").get_text() == "7"
    assert section.select_one("#state-slot-bytes").get_text() == "18.0 MiB"
    assert section.select_one("#state-slots-bar")["style"] == "--f: 0.750"
    assert section.select_one("#state-ckpt-bar")["style"] == "--f: 0.312"


def test_a_pool_without_slots_is_hidden(client, pool):
    pool.now = {name: 0 for name in USAGE}
    assert client.get("/dashboard.json").json()["state"]["state_pool"] is None
    assert page(client).select_one("section#state-pool") is None


def test_a_usage_without_a_field_is_refused_by_name(client, pool):
    del pool.now["state_checkpoint_hits"]
    with pytest.raises(KeyError, match="state_checkpoint_hits"):
        state_pool(client.app.state.engine)


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"),
                                         (1536, "1.5 KiB"), (18 * 2**20, "18.0 MiB"),
                                         (3 * 2**31, "6.0 GiB")])
def test_bytes_in_binary_units(n, text):
    assert fmt_bytes(n) == text
