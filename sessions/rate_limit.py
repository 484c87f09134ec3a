"""A worker's frames per second (GRADIENT_WORKER_RATE_PER_SEC and _BURST): past them, Error
rate_limited instead of work."""

import time


class TokenBucket:
    """Per-connection rate limit: a flood of frames gets Errors instead of work."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
