"""tests.submit"""
