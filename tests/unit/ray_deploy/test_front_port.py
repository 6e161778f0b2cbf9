"""The Ray front binds its port after the deploy; a port it cannot bind is refused before the deploy starts."""

from __future__ import annotations

import socket

import pytest

from specsplit.ray_deploy.front import _check_bindable

pytestmark = pytest.mark.unit


def test_a_port_in_use_is_refused_naming_it_and_a_free_one_passes():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=rf"could not bind 127.0.0.1:{port} .*is the port in use\?"):
            _check_bindable("127.0.0.1", port)
    _check_bindable("127.0.0.1", port)  # released: bindable again
    _check_bindable("127.0.0.1", 0)
