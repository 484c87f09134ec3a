"""The key a checkout makes for itself when DJANGO_SECRET_KEY is unset."""

import os
import subprocess
import sys
from pathlib import Path

from gradient.secret_key import checkout_secret_key

ROOT = Path(__file__).resolve().parents[1]
MAKE_KEY = (
    "import sys; from pathlib import Path; from gradient.secret_key import checkout_secret_key;"
    " print(checkout_secret_key(Path(sys.argv[1])))"
)


def test_a_key_is_made_once_private_and_then_kept(tmp_path):
    path = tmp_path / "run" / "secret_key"
    key = checkout_secret_key(path)
    assert len(key) >= 50
    assert checkout_secret_key(path) == key
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["secret_key"]  # no candidate left


def test_processes_starting_at_once_agree_on_one_key(tmp_path):
    for trial in range(10):
        path = tmp_path / str(trial) / "secret_key"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", MAKE_KEY, str(path)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(8)
        ]
        keys = {proc.communicate(timeout=60)[0].strip() for proc in procs}
        assert keys == {path.read_text().strip()}, keys
        assert [p.name for p in path.parent.iterdir()] == ["secret_key"]


def test_settings_use_the_environment_key_else_the_checkouts():
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "gradient.settings"}

    def key(**extra):
        run = subprocess.run(
            [sys.executable, "-c", f"import django; django.setup(); {code}"],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        return run.stdout.strip()

    assert key(DJANGO_SECRET_KEY="from-the-environment") == "from-the-environment"
    # Set but empty, so that a developer's .env cannot fill it in either.
    assert key(DJANGO_SECRET_KEY="") == (ROOT / "run" / "secret_key").read_text().strip()
