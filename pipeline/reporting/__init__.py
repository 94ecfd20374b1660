"""pipeline/reporting"""
