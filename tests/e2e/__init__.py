"""tests.e2e"""
