"""Serving trained policies over HTTP on Ray Serve (`rlplatform serve`): request checks and the Serve application."""
