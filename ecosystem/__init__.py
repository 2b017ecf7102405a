"""Placement: machine topology -> worker plan -> PM2 / supervisord / systemd configs."""
