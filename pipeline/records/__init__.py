"""pipeline/records"""
