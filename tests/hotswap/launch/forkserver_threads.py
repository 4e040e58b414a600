"""Imported by a fork server in tests/hotswap/launch/test_forkserver.py: starts a thread on import, as a
module that is unsafe to fork from would; the server must then refuse to fork."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), name="preload-thread", daemon=True).start()
