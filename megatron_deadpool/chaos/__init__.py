"""Soak testing (`deadpool chaos`): failure schedules drawn from a seed, checked bitwise."""
