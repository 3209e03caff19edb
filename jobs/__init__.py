"""Periodic jobs started by systemd timers: toko-recap and toko-backup."""
