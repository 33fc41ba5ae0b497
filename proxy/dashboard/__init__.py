"""The dashboard page's static files (index.html, login.html, app.js, app.css), shipped as package data
and served by proxy/dashboard_routes.py. No code here."""
