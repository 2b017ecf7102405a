"""The Sentinel tests' cluster: 1 primary, 1 replica, 3 Sentinels on loopback. It lives in
ecosystem/local/sentinel.py, which `fleet soak` shares."""

from ecosystem.local.sentinel import DOWN_AFTER_MS, SERVICE, SentinelCluster

__all__ = ["DOWN_AFTER_MS", "SERVICE", "SentinelCluster"]
